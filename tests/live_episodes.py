"""Reading the records of a live SGLang engine run (faultlab.sglang_live.harness), shared by the live tests."""
import pytest


def episode(run: dict, label: str) -> dict:
    """The episode's record; when the server died in it before its clients got their answers, fail."""
    if label not in run["episodes"]:
        pytest.fail(run["deaths"].get(label)
                    or f"{run.get('name', 'engine')}: episode {label!r} never ran: {run['deaths']}")
    return run["episodes"][label]


def by_index(ep: dict) -> dict:
    """The episode's requests by their index in the episode (``a0``, ``b1``, ...)."""
    return {req["rid"].split("-", 1)[1]: req for req in ep["requests"]}
