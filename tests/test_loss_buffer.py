"""The agent's loss watch survives loss tensors that cannot be read later (CUDA-graph trees overwrite them on the
next replay): each step's scalar is copied into a small device buffer when it is seen."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from guard.inside.agent import LossWatch  # noqa: E402


class FakeAgent:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True

    def wait_stop(self) -> None:
        pass


class Overwritten(torch.Tensor):
    """A loss that raises on any access, and so does every tensor made from it (``detach()``), once its ``cell`` is
    marked overwritten (as a CUDA-graph output after the next replay)."""

    cell: dict[str, bool]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cells = [a.cell for a in args if isinstance(a, Overwritten) and hasattr(a, "cell")]
        if any(cell["overwritten"] for cell in cells):
            raise RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten by a "
                               "subsequent run")
        result = super().__torch_function__(func, types, args, kwargs or {})
        if cells and isinstance(result, Overwritten):
            result.cell = cells[0]
        return result


def replayed(value: float) -> Any:
    loss = torch.tensor(value).as_subclass(Overwritten)
    loss.cell = {"overwritten": False}
    return loss


def test_losses_kept_between_two_reads_are_read_from_the_buffer_not_the_overwritten_tensors() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=1, check_every=4)  # type: ignore[arg-type]
    watch.observe(torch.tensor(5.0), None, "backward")  # the sanity step, read at once
    for value in (4.0, 3.0, float("nan"), 2.0):
        loss = replayed(value)
        watch.observe(loss, None, "backward")
        loss.cell["overwritten"] = True  # the next replay overwrote it (the window is read after the 4th)
    steps = [(m["step"], m["finite"]) for m in fake.sent]
    assert steps == [(1, True), (4, False)], fake.sent  # the first non-finite step of the window, exactly


def test_the_buffer_is_reused_window_after_window() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=0, check_every=3)  # type: ignore[arg-type]
    for step in range(1, 10):
        watch.observe(torch.tensor(float(step)), None, "backward")
    assert [(m["step"], m["loss"], m["n"]) for m in fake.sent] == [(3, 3.0, 3), (6, 6.0, 3), (9, 9.0, 3)]


def test_under_gradient_accumulation_a_step_is_an_optimizer_step() -> None:
    """Issue 33 item 8: with an optimizer built, the micro-batches of one optimizer step share its number (nanoGPT
    at 40 micro-batches reported step 641 for its iteration 16); only the first optimizer that steps is counted (a
    GAN's two optimizers: one step each per iteration); a resume's step is where the count goes on from."""
    agent = FakeAgent()
    watch = LossWatch(agent, sanity_steps=100, check_every=1)  # every loss sent at once: each one's step is seen
    generator, discriminator = object(), object()
    watch.optimizer_built()
    for _ in range(3):  # three optimizer steps of 4 micro-batches each
        for _ in range(4):
            watch.observe(torch.tensor(1.0), None, "backward")
        watch.optimizer_stepped(generator)
        watch.optimizer_stepped(discriminator)
    # one message per optimizer step, once it is whole, its loss the sum of its 4 micro-batches
    assert [(m["step"], m["loss"]) for m in agent.sent] == [(1, 4.0), (2, 4.0), (3, 4.0)]
    watch.resumed(100)
    watch.observe(torch.tensor(1.0), None, "backward")
    watch.optimizer_stepped(generator)
    assert agent.sent[-1]["step"] == 104


def test_without_an_optimizer_a_step_is_a_backward_call() -> None:
    agent = FakeAgent()
    watch = LossWatch(agent, sanity_steps=100, check_every=1)
    for _ in range(3):
        watch.observe(torch.tensor(1.0), None, "backward")
    assert [m["step"] for m in agent.sent] == [1, 2, 3]
    watch.observe(torch.tensor(1.0), 50, "report")  # a step the job names is its own
    assert agent.sent[-1]["step"] == 50
