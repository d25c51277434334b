"""What becomes of the candidates the stages produced: the judging steps of the graph, one `Judge` each
(steps), the gates each must pass (gates), which one takes the alias (decide), registration and the alias
move (promote), promoted engines laid out for serving where their backend declares how (serving), signed
webhooks and their mirror in MLflow (notify, mlflow_webhooks), the run's picture (summary_figure), and
`smelter compare` for a user who doubts a decision (compare). It may import every other folder of tasks/;
none of them imports it: only tasks/graph.py and flows/ may.
"""
