"""The agent's transformers hooks (``guard.inside.agent._transformers``) on a tiny real ``Trainer`` (CPU, a
two-weight model, a few steps) in this process, with a fake agent that records what the hooks report."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from guard.inside.agent import _core as agent_module  # noqa: E402 - after the skips
from guard.inside.agent import _transformers  # noqa: E402


class FakeAgent:
    """What the hooks call on ``guard.inside.agent.Agent``; requests are set by the test."""

    def __init__(self, *, request: dict[str, Any] | None = None, stop: bool = False,
                 resume_path: str | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.losses: list[tuple[float, int | None, str]] = []
        self.checkpoint_request = request
        self.stop_requested = stop
        self.ended = False
        self.begun = 0
        self.backward_hook = True
        self.trainer = False
        self.settings = SimpleNamespace(resume_path=resume_path)
        self.watch = SimpleNamespace(flush=lambda source: None)
        self.run_id_reads = 0  # node 0's run id looked for before a save is reported and at the end
        self.relay = SimpleNamespace(learn_run_id=self._learn_run_id)

    def _learn_run_id(self) -> None:
        self.run_id_reads += 1

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True

    def ask(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def on_loss(self, loss: Any, step: int | None, source: str) -> None:
        self.losses.append((float(loss), step, source))

    def checkpoint_due(self) -> bool:
        return self.checkpoint_request is not None

    def checkpoint_done(self, path: str, step: int | None, *, save_s: float | None = None, zero: bool = True) -> None:
        request, self.checkpoint_request = self.checkpoint_request, None
        if request is not None and request.get("stop"):
            self.stop_requested = True
        self.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "step": step, "requested": True,
                   "zero": zero})

    def end_process(self) -> None:
        self.ended = True

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m["t"] == kind]


class TinyModel(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([0.5, -0.5]))

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        prediction = x @ self.weight
        return {"loss": ((prediction - labels) ** 2).mean()}


class Rows(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, count: int = 64, bad_from: int | None = None) -> None:
        self.count, self.bad_from = count, bad_from

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.bad_from is not None and index >= self.bad_from:
            raise ValueError(f"row {index} is corrupt")
        return {"x": torch.tensor([float(index % 3), 1.0]), "labels": torch.tensor(1.0)}


@pytest.fixture
def trainer_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A Trainer subclass whose ``__init__`` the hooks wrap (``transformers.Trainer`` itself stays untouched)."""
    subclass = type("GuardedTrainer", (transformers.Trainer,), {})
    _transformers.patch(SimpleNamespace(Trainer=subclass))
    return subclass


def make(trainer_class: Any, tmp_path: Path, agent: FakeAgent | None, monkeypatch: pytest.MonkeyPatch, *,
         max_steps: int = 4, dataset: Any = None) -> Any:
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2, save_strategy="steps",
        save_steps=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    return trainer_class(model=TinyModel(), args=args, train_dataset=dataset or Rows())


def test_losses_settings_saves_and_the_end_are_reported(trainer_class: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = FakeAgent()
    trainer = make(trainer_class, tmp_path, agent, monkeypatch)
    assert agent.trainer and not agent.backward_hook  # the Trainer gives the losses, not .backward()
    trainer.train()
    (config,) = agent.of("trainer_config")
    assert config["config"]["max_steps"] == 4 and config["config"]["output_dir"] == str(tmp_path / "out")
    assert config["config"]["save_strategy"] == "steps" and config["config"]["world_process_zero"] is True
    assert [(step, source) for _, step, source in agent.losses] == [(1, "trainer"), (2, "trainer"), (3, "trainer"),
                                                                    (4, "trainer")]
    assert all(loss >= 0 for loss, _, _ in agent.losses) and agent.begun == 4
    saves = agent.of("checkpoint_saved")
    assert [(m["step"], m["requested"], m["zero"]) for m in saves] == [(2, False, True), (4, False, True)]
    assert all(Path(m["path"]).is_dir() for m in saves)
    (end,) = agent.of("train_end")  # stopped: the Trainer's own stop at max_steps counts too
    assert (end["step"], end["max_steps"]) == (4, 4)
    assert not agent.ended
    assert agent.run_id_reads == 3  # before each of the two saves is reported, and at the end


def test_a_checkpoint_request_with_stop_saves_then_ends_training(trainer_class: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    agent = FakeAgent(request={"t": "checkpoint", "stop": True})
    trainer = make(trainer_class, tmp_path, agent, monkeypatch, max_steps=10)
    trainer.train()
    (saved,) = agent.of("checkpoint_saved")
    assert saved["step"] == 1 and saved["requested"] and Path(saved["path"]).name == "checkpoint-1"
    assert agent.of("train_end")[0]["stopped"] is True and agent.of("train_end")[0]["step"] == 1
    assert agent.ended  # the script's code after train() does not run as if training had finished


def test_a_stop_request_ends_training_at_the_next_step(trainer_class: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    agent = FakeAgent(stop=True)
    make(trainer_class, tmp_path, agent, monkeypatch, max_steps=10).train()
    assert len(agent.losses) == 1 and agent.of("train_end")[0]["stopped"] is True and agent.ended


def test_train_raising_is_reported_before_the_script_sees_it(trainer_class: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    agent = FakeAgent()
    trainer = make(trainer_class, tmp_path, agent, monkeypatch, max_steps=10, dataset=Rows(count=64, bad_from=0))
    with pytest.raises(ValueError, match="is corrupt"):
        trainer.train()
    (error,) = agent.of("train_error")
    assert error["exc_type"] == "ValueError" and error["step"] == 0 and error["max_steps"] == 10


def test_without_an_agent_the_trainer_is_left_alone(trainer_class: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = make(trainer_class, tmp_path, None, monkeypatch, max_steps=2)
    assert getattr(trainer, "_guard_callback", None) is None
    trainer.train()


def test_a_fetched_checkpoint_is_resumed_unless_the_script_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeTrainer:
        """The Trainer's methods the hooks wrap, recording how ``train`` was called."""

        def __init__(self) -> None:
            self.callbacks: list[Any] = []
            self.calls: list[dict[str, Any]] = []

        def add_callback(self, callback: Any) -> None:
            self.callbacks.append(callback)

        def training_step(self, *args: Any) -> Any:
            return torch.tensor(1.0)

        def train(self, *args: Any, **kwargs: Any) -> str:
            self.calls.append(kwargs)
            return "done"

    agent = FakeAgent(resume_path="/out/checkpoint-30")
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    _transformers.patch(SimpleNamespace(Trainer=FakeTrainer))
    trainer = FakeTrainer()
    assert trainer.train() == "done" and trainer.calls[-1] == {"resume_from_checkpoint": "/out/checkpoint-30"}
    trainer.train(resume_from_checkpoint="/mine")
    assert trainer.calls[-1] == {"resume_from_checkpoint": "/mine"}
    trainer.training_step()
    assert agent.begun == 1 and len(trainer.callbacks) == 1


def test_training_arguments_are_reported_once_when_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    agent = FakeAgent()
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    subclass = type("GuardedArguments", (transformers.TrainingArguments,), {})
    _transformers.patch_arguments(SimpleNamespace(TrainingArguments=subclass))
    for _ in range(2):
        subclass(output_dir=str(tmp_path / "o"), report_to=[], use_cpu=True, push_to_hub=False, save_strategy="no")
    (reported,) = agent.of("training_args")
    assert reported["config"]["save_strategy"] == "no" and reported["config"]["output_dir"] == str(tmp_path / "o")
    assert "max_steps" not in reported["config"]
