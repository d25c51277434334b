# The MLflow server of docker/compose.yaml, built once: the same mlflow the project pins (constraints.txt),
# Postgres's driver for the backend store and boto3 for the MinIO (S3) artifact store.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.8 \
    && rm /tmp/constraints.txt

EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
