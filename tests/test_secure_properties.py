"""Property-based test of what the destination holds: the real securing code and a real folder destination
driven through random orders of saves, losses, pushes, signals, deadlines and exits (``secure_machine``), the
destination's bytes checked after every step and against the VERDICT at the end. The CI profile is derandomized
and small (real files, an in-process push).

The same machine runs against the local Hub server with Xet on (``HubSecureMachine``: two commits a push, every
model file uploaded by hf_xet, the record commit's ``last-checkpoint/`` downloaded and checked on its bytes after
every step, the next run's fetch at the end), with fewer examples: a Hub push costs tens of milliseconds where a
folder's costs one."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from secure_machine import HubSecureMachine, SecureMachine

from tests.hubserver import HubServer, client_constants

settings.register_profile("secure-ci", max_examples=200,
                          stateful_step_count=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("secure-hub-ci", max_examples=150, stateful_step_count=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("guard")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


TestDestinationHoldsWhatTheVerdictSays = SecureMachine.TestCase
TestDestinationHoldsWhatTheVerdictSays.settings = settings.get_profile("secure-ci")


@pytest.fixture(scope="module")
def _hub() -> Iterator[None]:
    with client_constants(xet=True), HubServer() as server:
        HubSecureMachine.hub = server
        yield
        HubSecureMachine.hub = None


TestHubHoldsWhatTheVerdictSays = pytest.mark.hub(pytest.mark.slow(pytest.mark.usefixtures("_hub")(
    HubSecureMachine.TestCase)))
TestHubHoldsWhatTheVerdictSays.settings = settings.get_profile("secure-hub-ci")


def _replay(*steps: tuple[str, dict[str, object]], kind: type[SecureMachine] = SecureMachine) -> SecureMachine:
    """One order of the machine's rules, the destination checked after each (as hypothesis runs them)."""
    machine = kind()
    try:
        machine.start(timeout_s=None, background=True)
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.destination_holds_a_good_save()
    finally:
        machine.teardown()
    return machine


def test_a_save_inside_the_loss_window_after_a_nan_never_reaches_the_destination() -> None:
    """The NaN-window push (the machine's shrunk example on the code before the hold): losses are read every 4
    steps; step 2's loss is NaN and not read yet when ``checkpoint-2`` is reported; a second later it was pushed and
    recorded as ``DEST/last-checkpoint`` (weights not finite)."""
    _replay(("train", {"n": 1, "bad": None}), ("read_losses", {}), ("tick", {"dt": 0.3}),
            ("train", {"n": 1, "bad": "nan"}), ("save", {"how": "folder", "read_first": False, "requested": False}),
            ("tick", {"dt": 1.0}), ("train", {"n": 2, "bad": None}), ("tick", {"dt": 1.0}), ("end", {}))


def test_a_save_whose_weights_the_agent_saw_non_finite_is_never_secured() -> None:
    """The weights are a witness (ModernBERT #233): the loss of step 3 was finite, its update made the weights NaN,
    ``checkpoint-3`` holds them (``file_saved`` says ``finite: false``); the failure read at step 4 secured it."""
    _replay(("train", {"n": 3, "bad": None}), ("weights_go_bad", {}),
            ("save", {"how": "folder", "read_first": False, "requested": False}), ("train", {"n": 1, "bad": None}),
            ("tick", {"dt": 1.0}), ("end", {}))


def test_a_save_renamed_after_the_agent_saw_it_non_finite_is_never_secured() -> None:
    """timm's ``tmp.pth.tar`` renamed to ``last.pth.tar`` (timm PR #693) holding weights the agent saw non-finite:
    the flag stayed on the temporary name and ``last.pth.tar`` (step 1, NaN weights) was secured once the scans
    followed the rename (a derandomized example of the machine, on the code before the scans passed the rename on)."""
    _replay(("weights_go_bad", {}), ("train", {"n": 1, "bad": None}),
            ("save", {"how": "renamed", "read_first": False, "requested": False}), ("tick", {"dt": 0.3}),
            ("tick", {"dt": 1.0}))


NAN_AFTER_RECORDED = (("train", {"n": 2, "bad": None}),
                      ("save", {"how": "in_place", "read_first": True, "requested": False}), ("tick", {"dt": 1.0}),
                      ("tick", {"dt": 1.0}), ("tick", {"dt": 1.0}), ("train", {"n": 1, "bad": None}),
                      ("save", {"how": "in_place", "read_first": True, "requested": False}), ("tick", {"dt": 1.0}),
                      ("tick", {"dt": 1.0}), ("tick", {"dt": 1.0}),
                      ("train", {"n": 1, "bad": "nan"}), ("read_losses", {}), ("tick", {"dt": 1.0}), ("end", {}))


def test_a_recorded_save_made_suspect_by_the_next_steps_nan_is_moved_back_on_the_destination() -> None:
    """The nanoGPT pattern (``ckpt.pt`` saved in place): step 2 then step 3 pushed and recorded, then step 4's loss
    is NaN, so the save of step 3 (its weights gave that loss) is suspect. Step 2 is no longer on the disk (saved
    over): before, the guard tried to push it again, was refused, and ended ``secured=no`` with no word that
    ``DEST/last-checkpoint`` held step 3; now the record is swapped back to step 2 and the VERDICT names it."""
    machine = _replay(*NAN_AFTER_RECORDED)
    assert [h.op for h in machine.pusher.started][-1] == "restore_checkpoint"


@pytest.mark.hub
@pytest.mark.slow
@pytest.mark.usefixtures("_hub")
def test_a_hub_record_made_suspect_by_the_next_steps_nan_is_moved_back_by_a_record_commit() -> None:
    """The same order against the local Hub server with Xet: the record commit naming step 2's files again is read
    back on its bytes (``HubSecureMachine.held``) and fetched as the next run's resume would."""
    machine = _replay(*NAN_AFTER_RECORDED, kind=HubSecureMachine)
    assert [h.op for h in machine.pusher.started][-1] == "restore_checkpoint"
