"""Static analysis of job scripts (``ast`` + PEP 723), on real tiny scripts in temporary folders."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from guard.preflight.script import analyze_script, read_pep723


def write(folder: Path, text: str, name: str = "train.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


SFT = '''
    # /// script
    # requires-python = ">=3.10"
    # dependencies = [
    #   "torch>=2.0",
    #   "transformers",
    # ]
    # ///
    import os
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from datasets import load_dataset
    try:
        import wandb
    except ImportError:
        wandb = None

    MODEL = "acme/tiny-gpt2"
    ds = load_dataset("acme/tiny-text", split="train")
    local = load_dataset("json", data_files="x.json")
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.gradient_checkpointing_enable()
    args = TrainingArguments(
        output_dir="out/run1",
        evaluation_strategy="steps",
        push_to_hub=True,
        hub_model_id="acme/tiny-ft",
        bf16=True,
        report_to="wandb",
        max_steps=10,
        learning_rate=float(os.environ.get("LR", "1e-4")),
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    model.save_pretrained("acme/final")
'''


def test_hub_ids_config_and_imports_are_read_without_running(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, SFT))
    assert facts.models == ("acme/tiny-gpt2",)
    assert facts.datasets == ("acme/tiny-text",)  # "json" is a builder, not a Hub id
    assert facts.hub_model_ids == ("acme/tiny-ft",)
    assert facts.trainer_config == {
        "output_dir": "out/run1", "eval_strategy": "steps", "push_to_hub": True, "hub_model_id": "acme/tiny-ft",
        "bf16": True, "report_to": ["wandb"], "max_steps": 10, "has_eval_dataset": False,
        "gradient_checkpointing": True,
    }
    assert facts.imports == ("os", "torch", "transformers", "datasets")  # wandb is optional (inside try)
    assert facts.trackers == frozenset()  # a bare optional import is not a tracker
    assert facts.pep723 is not None and facts.pep723.dependencies == ("torch>=2.0", "transformers")
    assert facts.pep723.requires_python == ">=3.10"


def test_the_script_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    facts = analyze_script(write(tmp_path, f"open({str(marker)!r}, 'w').write('x')\n"))
    assert facts.syntax_error is None
    assert not marker.exists()


def test_names_assigned_twice_are_not_guessed(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        import sys
        from transformers import AutoModel
        name = "acme/a"
        if sys.argv[1:]:
            name = "acme/b"
        AutoModel.from_pretrained(name)
        AutoModel.from_pretrained("acme/c")
    '''))
    assert facts.models == ("acme/c",)


def test_local_paths_and_saved_folders_are_not_hub_ids(tmp_path: Path) -> None:
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    facts = analyze_script(write(tmp_path, '''
        from datasets import load_dataset
        from transformers import AutoModel
        load_dataset("data/corpus")
        load_dataset("./local")
        model = AutoModel.from_pretrained("acme/base")
        model.save_pretrained("results/final")
        again = AutoModel.from_pretrained("results/final")
        bare = AutoModel.from_pretrained("gpt2")
    '''))
    assert facts.datasets == ()
    assert facts.models == ("acme/base",)


def test_other_loaders_name_hub_ids(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        from huggingface_hub import hf_hub_download, snapshot_download
        from peft import PeftModel
        from sentence_transformers import SentenceTransformer
        from transformers import pipeline
        from trl import SFTConfig, SFTTrainer
        st = SentenceTransformer("acme/st-model")
        pipe = pipeline("text-generation", model="acme/pipe-model")
        peft = PeftModel.from_pretrained(base, "acme/adapter")
        snapshot_download(repo_id="acme/ds-files", repo_type="dataset")
        hf_hub_download("acme/dl-model", "config.json")
        trainer = SFTTrainer(model="acme/trl-model", args=SFTConfig(output_dir="o", torch_compile=True),
                             train_dataset=ds, eval_dataset=ds_eval)
    '''))
    assert facts.models == ("acme/st-model", "acme/pipe-model", "acme/adapter", "acme/dl-model", "acme/trl-model")
    assert facts.datasets == ("acme/ds-files",)
    assert facts.trainer_config["torch_compile"] is True
    assert facts.trainer_config["has_eval_dataset"] is True


def test_trackers_and_trackio_space_privacy(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        import trackio, wandb, mlflow
        trackio.init(project="p", space_id="acme/dash")
        wandb.init(project="p")
        mlflow.start_run()
    '''))
    assert facts.trackers == frozenset({"trackio", "wandb", "mlflow"})
    assert facts.trackio_space_id == "acme/dash" and facts.trackio_private is None
    text = 'import trackio\ntrackio.init(project="p", space_id="a/b", private=True)\n'
    private = analyze_script(write(tmp_path, text))
    assert private.trackio_private is True


def test_cached_loss_is_the_loss_class(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=32)
        args = SentenceTransformerTrainingArguments(output_dir="o", gradient_checkpointing=True)
        SentenceTransformerTrainer(model=model, args=args, train_dataset=ds, loss=loss)
    '''))
    assert facts.trainer_config["loss_class"] == "CachedMultipleNegativesRankingLoss"
    assert facts.trainer_config["gradient_checkpointing"] is True


def test_conflicting_training_arguments_are_dropped_and_kwargs_make_eval_unknown(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        from transformers import Trainer, TrainingArguments
        a = TrainingArguments(output_dir="o", bf16=True, save_strategy="no")
        b = TrainingArguments(output_dir="o", bf16=False, save_strategy="no")
        Trainer(model=m, args=a, **extra)
    '''))
    assert "bf16" not in facts.trainer_config
    assert facts.trainer_config["save_strategy"] == "no"
    assert "has_eval_dataset" not in facts.trainer_config


def test_syntax_error_is_reported(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, "def broken(:\n    pass\n"))
    assert facts.syntax_error is not None and facts.syntax_error.startswith("line 1")


def test_pep723_two_blocks_are_an_error() -> None:
    block = "# /// script\n# dependencies = []\n# ///\n"
    result = read_pep723(block + "\n" + block)
    assert result is not None and result.error is not None and "2 `# /// script` blocks" in result.error


def test_pep723_bad_toml_is_an_error() -> None:
    result = read_pep723('# /// script\n# dependencies = ["a"\n# ///\n')
    assert result is not None and result.error is not None and "not valid TOML" in result.error


@pytest.mark.parametrize("text", [
    "print('no block')\n",
    "# /// script\n# dependencies = []\n",            # unclosed: ignored, per the specification
    "# /// pyproject\n# dependencies = []\n# ///\n",  # another type
])
def test_pep723_no_script_block(text: str) -> None:
    assert read_pep723(text) is None


def test_pep723_bare_comment_lines_and_wrong_types() -> None:
    ok = read_pep723('# /// script\n#\n# dependencies = ["a>=1"]\n#\n# ///\n')
    assert ok is not None and ok.dependencies == ("a>=1",) and ok.error is None
    bad = read_pep723('# /// script\n# dependencies = "a"\n# ///\n')
    assert bad is not None and bad.error is not None and "not a list" in bad.error


def test_an_evaluator_counts_as_evaluation_data(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        args = SentenceTransformerTrainingArguments(output_dir="o", eval_strategy="steps")
        SentenceTransformerTrainer(model=model, args=args, train_dataset=ds, evaluator=dev_evaluator)
    '''))
    assert facts.trainer_config["has_eval_dataset"] is True


def test_explicit_push_to_hub_calls_are_hub_writes(tmp_path: Path) -> None:
    from guard.preflight import PreflightOptions
    from guard.preflight._job import HubTarget, JobView

    facts = analyze_script(write(tmp_path, '''
        from transformers import AutoModel
        model = AutoModel.from_pretrained("acme/base")
        model.push_to_hub("acme/finetuned", private=True)
    '''))
    assert facts.push_calls == ("acme/finetuned",)
    view = JobView.build(PreflightOptions(script=facts.path), facts, {})
    assert view.hub_target == HubTarget("model", "acme/finetuned", "push_to_hub('acme/finetuned') in train.py")
    bare = analyze_script(write(tmp_path, 'from transformers import TrainingArguments\n'
                                          'args = TrainingArguments(output_dir="o", hub_model_id="acme/m")\n'
                                          'trainer.push_to_hub()\n'))
    view = JobView.build(PreflightOptions(script=bare.path), bare, {})
    assert view.hub_target is not None and view.hub_target.repo_id == "acme/m"
