"""The watchdog policy, fed events with plain clock values: no process, no socket, no sleeping."""

from __future__ import annotations

import math
from typing import Any

from guard.core.state import Outcome, RunState
from guard.run.watchdog import NAN_SETTLE_S, STACKS_WAIT_S, Decision, Watchdog


def make(*, sanity_steps: int = 3, stall_timeout_s: float = 60.0, dry_run: bool = False,
         max_skipped_steps: int = 0) -> tuple[Watchdog, RunState]:
    state = RunState()
    return Watchdog(state, 0.0, sanity_steps=sanity_steps, stall_timeout_s=stall_timeout_s, dry_run=dry_run,
                    max_skipped_steps=max_skipped_steps), state


def apply(state: RunState, dog: Watchdog, decisions: list[Decision]) -> None:
    """What the loop does with a decision: the first outcome stands, and the watches stop."""
    for decision in decisions:
        if state.outcome is None:
            state.outcome = decision.outcome
            dog.pause()


def test_sanity_pass_after_the_first_finite_losses() -> None:
    dog, state = make(sanity_steps=3)
    for step, loss in enumerate((2.5, 2.4, 2.3, 2.2), start=1):
        seen = dog.on_step(float(step), step, loss)
        assert seen.counted and seen.decisions == []
    assert state.progress.sanity == [2.5, 2.4, 2.3] and state.progress.sanity_done
    assert (state.progress.step, state.progress.loss, state.progress.loss_source) == (4, 2.2, "agent")


def test_dry_run_stops_the_job_once_the_sanity_pass_is_done() -> None:
    dog, _state = make(sanity_steps=2, dry_run=True)
    assert dog.on_step(1.0, 1, 1.0).decisions == []
    decisions = dog.on_step(2.0, 2, 0.9).decisions
    assert [(d.outcome.status, d.outcome.reason, d.outcome.exit_code, d.stop) for d in decisions] == \
        [("PASS", "dry_run", 0, True)]


def test_a_nan_on_one_process_decides_at_once_and_keeps_no_finite_loss() -> None:
    dog, state = make()
    dog.on_step(1.0, 1, 2.0)
    decisions = dog.on_step(2.0, 2, 5.0, finite=False)  # the agent's device check said non-finite
    assert len(decisions.decisions) == 1
    outcome = decisions.decisions[0].outcome
    assert (outcome.status, outcome.reason, outcome.exit_code) == ("FAIL", "non_finite_loss", 4)
    assert "rank" not in outcome.extra and "batch of step 2" in (outcome.hint or "")
    assert state.progress.step == 2 and state.progress.loss is not None and math.isnan(state.progress.loss)


def test_a_report_read_after_the_nan_decided_leaves_its_step_and_loss() -> None:
    # guard.protect()'d jobs/protected.py reports steps 1-3 and exits: the three messages can come in one read, and
    # step 3's finite loss moved step= past the first bad step (and its loss= was then dropped as finite).
    dog, state = make()
    dog.on_step(1.0, 1, 1.0)
    apply(state, dog, dog.on_step(1.0, 2, math.nan, finite=False).decisions)
    later = dog.on_step(1.0, 3, 0.5)
    assert not later.counted and later.decisions == []
    assert state.progress.step == 2 and state.progress.loss is not None and math.isnan(state.progress.loss)


def test_a_batch_of_steps_names_its_range() -> None:
    dog, state = make()
    decision = dog.on_step(1.0, 20, math.inf, n=10).decisions[0]
    assert "steps 11..20" in (decision.outcome.hint or "") and state.progress.loss == math.inf


def test_with_two_ranks_the_earliest_nan_and_its_rank_are_named() -> None:
    dog, state = make()
    ranks = frozenset({0, 1})
    dog.on_step(1.0, 5, 2.0, rank=0, live_ranks=ranks)
    dog.on_step(1.0, 5, 2.0, rank=1, live_ranks=ranks)
    # rank 0's NaN at step 7 (an echo through the all-reduce) arrives before rank 1's at step 6
    assert dog.on_step(2.0, 7, math.nan, rank=0, live_ranks=ranks).decisions == []
    assert dog.due_at() == 2.0 + NAN_SETTLE_S
    assert dog.tick(2.5, ranks) == []  # rank 1 has not reported as far as step 7 yet
    assert dog.on_step(2.6, 6, math.nan, rank=1, live_ranks=ranks).decisions == []
    decisions = dog.tick(2.7, ranks)  # every rank reported: settled before the deadline
    assert len(decisions) == 1 and decisions[0].outcome.extra == {"rank": 1}
    assert state.progress.step == 6


def test_a_nan_is_named_at_the_settle_deadline_when_a_rank_stays_silent() -> None:
    dog, _ = make()
    ranks = frozenset({0, 1})
    dog.on_step(1.0, 3, 2.0, rank=0, live_ranks=ranks)
    dog.on_step(2.0, 4, math.nan, rank=0, live_ranks=ranks)
    assert dog.tick(2.0 + NAN_SETTLE_S - 0.1, ranks) == []
    decisions = dog.tick(2.0 + NAN_SETTLE_S, ranks)
    assert len(decisions) == 1 and decisions[0].outcome.extra == {"rank": 0}


def test_only_the_lowest_rank_feeds_step_loss_and_sanity() -> None:
    dog, state = make(sanity_steps=2)
    assert dog.on_step(1.0, 1, 9.0, rank=1).counted  # the only rank seen yet
    assert not dog.on_step(1.1, 1, 2.0, rank=0).counted or state.progress.loss == 2.0
    assert not dog.on_step(2.0, 2, 8.0, rank=1).counted  # rank 0 is known now: rank 1 never stands for the job
    assert dog.on_step(2.1, 2, 1.9, rank=0).counted
    assert state.progress.step == 2 and state.progress.loss == 1.9
    assert 8.0 not in state.progress.sanity


def test_agents_without_a_rank_the_first_one_stands() -> None:
    dog, state = make()
    assert dog.on_step(1.0, 1, 3.0, agent=7).counted
    assert not dog.on_step(1.0, 1, 4.0, agent=9).counted
    assert state.progress.loss == 3.0


def test_agent_losses_replace_printed_ones_and_restart_the_sanity_pass() -> None:
    dog, state = make(sanity_steps=3)
    dog.on_step(1.0, 1, 5.0, source="output")
    assert state.progress.loss_source == "output" and state.progress.sanity == [5.0]
    dog.on_step(2.0, 1, 2.0, source="agent")
    assert state.progress.loss_source == "agent" and state.progress.sanity == [2.0]


def test_a_step_without_number_counts_on() -> None:
    dog, state = make()
    dog.on_step(1.0, None, 1.0)
    dog.on_step(2.0, None, 1.0, n=4)
    assert state.progress.step == 5


def test_no_output_at_all_is_a_stall_after_the_timeout() -> None:
    dog, _state = make(stall_timeout_s=60.0)
    dog.on_output(10.0)  # output counts as progress before the first step
    assert dog.due_at() == 70.0 and dog.tick(69.9) == []
    decision = dog.tick(70.0)[0]
    assert (decision.outcome.reason, decision.outcome.exit_code) == ("stalled", 5)
    assert decision.dump_stacks and not decision.stop and decision.stop_in_s == STACKS_WAIT_S
    assert "no output and no training step for 60s" in (decision.outcome.hint or "")


def test_output_after_the_first_step_is_not_progress() -> None:
    dog, _ = make(stall_timeout_s=30.0)
    dog.on_step(5.0, 1, 1.0)
    dog.on_output(30.0)
    decision = dog.tick(35.0)[0]
    assert "no training step for 30s" in (decision.outcome.hint or "")


def test_a_stall_after_training_ended_says_so() -> None:
    dog, state = make(stall_timeout_s=10.0)
    dog.on_step(1.0, 50, 1.0)
    state.facts.train_end = {"step": 50, "max_steps": 50, "stopped": False}
    decision = dog.tick(11.0)[0]
    assert "since training ended at step 50" in (decision.outcome.hint or "")


def test_cuda_graph_replays_are_progress() -> None:
    dog, _ = make(stall_timeout_s=10.0)
    dog.on_step(1.0, 1, 1.0)
    for now in (8.0, 16.0, 24.0):
        dog.on_replay(now, None)
        assert dog.tick(now + 5.0) == []


def test_a_silent_rank_while_the_other_goes_on_is_stalled_with_its_rank() -> None:
    dog, state = make(stall_timeout_s=60.0)
    dog.on_step(0.0, 1, 1.0, rank=0)
    dog.on_step(0.0, 1, 1.0, rank=1)
    for now in range(10, 70, 10):  # rank 1 goes on, rank 0 is stopped
        dog.on_step(float(now), now, 1.0, rank=1)
    decisions = dog.tick(61.0)
    assert len(decisions) == 1 and decisions[0].outcome.extra == {"rank": 0}
    assert decisions[0].outcome.reason == "stalled" and decisions[0].dump_stacks
    apply(state, dog, decisions)
    assert dog.tick(200.0) == []  # decided: no second verdict, the watches are paused


def test_a_rank_that_ended_training_is_not_stalled() -> None:
    dog, _ = make(stall_timeout_s=60.0)
    dog.on_step(0.0, 1, 1.0, rank=0)
    dog.on_step(0.0, 1, 1.0, rank=1)
    dog.on_train_end(1)  # rank 1 is done; rank 0 trains on
    for now in range(10, 70, 10):
        dog.on_step(float(now), now, 1.0, rank=0)
    assert dog.tick(61.0) == []


def test_the_stack_answers_name_the_rank_behind_and_where_it_waits() -> None:
    dog, state = make(stall_timeout_s=10.0)
    dog.on_step(0.0, 4, 1.0, rank=0)
    dog.on_step(0.0, 4, 1.0, rank=1)
    decisions = dog.tick(10.0)  # every rank silent together: the job-wide watch decides
    assert len(decisions) == 1 and decisions[0].outcome.reason == "stalled"
    apply(state, dog, decisions)
    dog.on_stack_answer(0, 5, "all_reduce (distributed_c10d.py:2501)")
    dog.on_stack_answer(1, 4, None)
    assert state.outcome is not None and state.outcome.extra["rank"] == 1
    assert state.facts.hang_where == "all_reduce (distributed_c10d.py:2501)"
    assert (state.outcome.hint or "").startswith("the main thread waits in all_reduce")


def test_skipped_optimizer_steps_past_the_limit_fail_without_a_loss() -> None:
    dog, state = make(max_skipped_steps=5)
    dog.on_step(1.0, 10, 2.0)
    assert dog.on_skipped(4, 11, None) == []
    decisions = dog.on_skipped(5, 12, 1)
    assert len(decisions) == 1 and decisions[0].outcome.reason == "non_finite_loss"
    assert decisions[0].outcome.extra == {"rank": 1} and "fp16 overflow" in (decisions[0].outcome.hint or "")
    assert state.progress.step == 12 and state.progress.loss is None


def test_skipped_steps_are_ignored_without_a_limit_or_after_a_decision() -> None:
    dog, _state = make(max_skipped_steps=0)
    assert dog.on_skipped(1000, 1, None) == []
    dog2, state2 = make(max_skipped_steps=2)
    state2.outcome = Outcome("TIMEOUT", "deadline")
    assert dog2.on_skipped(3, 1, None) == []


def test_an_exploding_finite_loss_is_named_once() -> None:
    dog, state = make()
    for step, loss in enumerate((2.0, 2.1, 1.9, 2.0, 2.2, 2.0), start=1):
        dog.on_step(float(step), step, loss)
    assert state.progress.exploded is None
    dog.on_step(7.0, 7, 500.0)
    assert state.progress.exploded == {"step": 7, "loss": 500.0, "early": 2.0}
    dog.on_step(8.0, 8, 9000.0)
    assert state.progress.exploded["step"] == 7


def test_ranks_seen_and_the_one_behind() -> None:
    dog, _ = make()
    assert dog.stuck_rank() is None and dog.newest_rank_step() is None
    dog.on_step(1.0, 8, 1.0, rank=0)
    dog.on_step(2.0, 6, 1.0, rank=1)
    dog.on_step(3.0, 8, 1.0, rank=2)
    assert dog.training_ranks() == {0, 1, 2} and dog.newest_rank_step() == 8 and dog.stuck_rank() == 1


def test_the_settings_check_fails_once_and_logs_each_row_once(caplog: Any) -> None:
    from guard.preflight._models import CheckResult
    from guard.run.watchdog import SettingsCheck

    rows = [CheckResult("env", "warn", "no WANDB_API_KEY", hint="set it"),
            CheckResult("save", "fail", "save_strategy=no", hint="save checkpoints")]
    check = SettingsCheck(lambda config: rows if config.get("save_strategy") == "no" else rows[:1])
    assert check.on_arguments({"save_strategy": "steps"}) is None
    decision = check.on_arguments({"save_strategy": "no"})
    assert decision is not None and decision.stop
    assert (decision.outcome.reason, decision.outcome.exit_code, decision.outcome.extra) == \
        ("preflight", 3, {"check": "save"})
    check.on_arguments({"save_strategy": "no"})
    assert sum("no WANDB_API_KEY" in r.message for r in caplog.records) == 1
    assert SettingsCheck(None).on_arguments({"save_strategy": "no"}) is None


def test_the_node_rank_from_the_environment_or_the_launcher() -> None:
    from guard.run.ranks import configured_node_rank

    assert configured_node_rank({"SLURM_NODEID": "2"}, ["python", "train.py"]) == 2
    assert configured_node_rank({}, ["torchrun", "--nnodes", "2", "--node-rank", "1", "train.py"]) == 1
    assert configured_node_rank({}, ["python", "train.py"]) is None


def test_a_loss_that_never_changes_is_named_once() -> None:
    """Issue 36 (visual_prompting #7: the optimizer held a copy of the parameters): a loss exactly the same for
    --loss-rise-steps steps is a warning, never a verdict."""
    state = RunState()
    dog = Watchdog(state, 0.0, sanity_steps=3, stall_timeout_s=60.0, loss_rise_steps=5)
    for step in range(1, 5):
        assert dog.on_step(float(step), step, 0.6931).decisions == []
        assert state.progress.flat is None  # 4 equal losses: not yet
    dog.on_step(5.0, 5, 0.6931)
    assert state.progress.flat == {"since": 1, "step": 5, "loss": 0.6931}
    dog.on_step(6.0, 6, 0.5)
    assert state.progress.flat["step"] == 5 and state.outcome is None


def test_losses_that_move_or_sit_at_zero_are_not_flat() -> None:
    state = RunState()
    dog = Watchdog(state, 0.0, sanity_steps=3, stall_timeout_s=60.0, loss_rise_steps=5)
    for step in range(1, 30):
        dog.on_step(float(step), step, 1.0 if step % 4 else 1.1)  # equal runs of 3, broken
    zero_state = RunState()
    zero = Watchdog(zero_state, 0.0, sanity_steps=3, stall_timeout_s=60.0, loss_rise_steps=5)
    for step in range(1, 30):
        zero.on_step(float(step), step, 0.0)  # zero from the start: the job's own choice
    assert state.progress.flat is None and zero_state.progress.flat is None


def test_a_loss_that_drops_to_exactly_zero_and_stays_is_named() -> None:
    """Issue 33 item 2 (ModernBERT #233): a masked "NaN-safe" loss reads 0.0 every step once nan_to_num hides the
    NaN; after non-zero losses, exactly 0.0 for --loss-rise-steps steps is a warning naming those causes."""
    from guard.run.watchdog import flat_loss_text

    state = RunState()
    dog = Watchdog(state, 0.0, sanity_steps=3, stall_timeout_s=60.0, loss_rise_steps=5)
    for step in range(1, 10):
        dog.on_step(float(step), step, 1.0 / step)
    for step in range(10, 15):
        dog.on_step(float(step), step, 0.0)
    assert state.progress.flat == {"since": 10, "step": 14, "loss": 0.0} and state.outcome is None
    assert "nan_to_num hiding NaN" in flat_loss_text(state.progress.flat)


def test_a_loss_that_explodes_at_the_first_update_is_named() -> None:
    # TRL's sft.py with a learning rate of 50 (measured): 3.13, then 2.0e4 and on; the median of the first five
    # losses was 1.7e4, so the explosion was measured against itself and the run ended PASS.
    dog, state = make()
    for step, loss in enumerate((3.13, 2.009e4, 6520.0, 1.746e4, 2.295e4, 3.0e4), start=1):
        dog.on_step(float(step), step, loss)
    assert state.progress.exploded == {"step": 2, "loss": 2.009e4, "early": 3.13}


def test_a_loss_falling_fast_in_its_first_steps_is_no_explosion() -> None:
    dog, state = make()
    for step, loss in enumerate((9.0, 4.0, 1.0, 0.5, 0.4, 0.45, 0.6, 2.0), start=1):
        dog.on_step(float(step), step, loss)
    assert state.progress.exploded is None


def test_non_finite_gradients_after_an_explosion_blame_the_divergence(caplog: Any) -> None:
    # nanoGPT's train.py with --learning_rate=1e6 (measured): loss 3.98, then 1.7e6, then clip_grad_norm_ returned
    # nan at step 3 while its loss was finite. The log said 'non-finite loss nan at step 3' and the hint sent the
    # user looking for a NaN-safe loss (torch.where, a masked mean) in the batch of step 3.
    caplog.set_level("INFO", logger="guard")
    dog, state = make()
    dog.on_step(1.0, 1, 3.98)
    dog.on_step(2.0, 2, 1.7e6)
    apply(state, dog, dog.on_step(3.0, 3, math.nan, finite=False, witness="grad_norm").decisions)
    assert state.outcome is not None and state.outcome.reason == "non_finite_loss"
    assert "overflowed as the loss diverged" in state.outcome.hint
    assert state.progress.witness == "grad_norm"  # securing's taint says so too (tests/test_plan.py)
    assert "NaN-safe" not in state.outcome.hint and "torch.where" not in state.outcome.hint
    assert "non-finite loss" not in caplog.text
    assert "clip_grad_norm_ returned at step 3 is not finite, its loss was finite (sanity pass)" in caplog.text


def test_non_finite_gradients_of_a_calm_run_point_at_the_loss_code() -> None:
    dog, state = make()
    for step, loss in enumerate((3.98, 3.9, 3.85, 3.8), start=1):
        dog.on_step(float(step), step, loss)
    apply(state, dog, dog.on_step(5.0, 5, math.nan, finite=False, witness="grad_norm").decisions)
    assert state.outcome is not None and "NaN-safe loss" in state.outcome.hint
