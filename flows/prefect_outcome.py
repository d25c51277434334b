"""What the Prefect UI shows of a run's outcome at a glance, where a person looks first.

Prefect colours a state by its type, whatever its name: a "Rejected" state of type COMPLETED is drawn
with the same green check as a success. So a candidate's last task ends in a type that is not green
unless it passed: promoted and passed are COMPLETED (green); rejected and pending are CANCELLED (grey:
it ran and was not taken, like the summary figure's grey bars), each named for what happened; a broken
stage is FAILED (red), so red keeps meaning that something broke. CANCELLED is final and never retried
(a returned FAILED state is retried when the task has retries), so a rejection changes neither the flow
run's state nor what runs. The flow run's name carries the counts, on its header and in the runs list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prefect.states import Cancelled, Completed, Failed, State

from tasks.outcome import CandidateOutcome, counted

STATE_NAMES = {"promoted": "Promoted", "passed": "Passed", "pending": "Pending (machine busy)",
               "rejected": "Rejected"}


def verdict_state(outcome: CandidateOutcome) -> State:
    """The final state of a candidate's verdict task: its status as the state's name, its reason as the message."""
    if outcome.status == "failed":
        return Failed(message=outcome.reason)
    ended = Completed if outcome.status in ("promoted", "passed") else Cancelled
    return ended(name=STATE_NAMES[outcome.status], message=outcome.reason)


def name_flow_run(statuses: Iterable[str]) -> None:
    """The current flow run renamed `<name>: <counts>` (e.g. `minilm: 1 promoted, 2 rejected`), so its header
    and the runs list say the outcome; a name that cannot be changed stays as it was (the message has the counts)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    base = context.flow_run.name.split(": ", 1)[0]
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(context.flow_run.id, name=f"{base}: {counted(statuses)}")
    except Exception:  # noqa: BLE001 - a name is a convenience; the run's message and result are the outcome
        return


def run_link(state: State[Any]) -> str | None:
    """The flow run in the Prefect UI of a lasting server (PREFECT_API_URL set); None for the temporary one,
    whose UI is gone when the run ends."""
    from prefect.settings import get_current_settings

    ui = get_current_settings().ui_url
    flow_run_id = state.state_details.flow_run_id
    if not ui or flow_run_id is None:
        return None
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}"
