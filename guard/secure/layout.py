"""Where a job keeps its checkpoints: its output folder, the paths it may report, what to say when none is found.

- ``output_dir_from_args``: the output folder named in the job's own arguments, for when ``--output-dir`` is not
  given (``--output_dir`` of ``TrainingArguments``/``HfArgumentParser`` scripts, ``--output-dir``, nanoGPT's
  ``--out_dir=``, Megatron's ``--save``), both ``--flag VALUE`` and ``--flag=VALUE``; a value that names a file
  (``--save model.pt``, pytorch/examples' word_language_model) gives the file's folder.
- ``output_dir_for_save``: the output folder of a file the job saved: the parent of its checkpoint-like folder
  (``out/checkpoint-20/model.pt`` -> ``out``), never the first save's own folder.
- ``check_reported_path``: a path from ``guard.checkpoint_saved(path)`` is pushed only when it lies inside the
  output folder; never ``/``, the home folder, the working folder or a folder above it (``checkpoint_saved("")``
  would otherwise secure the working folder).
- ``nothing_found_hint``: the VERDICT's hint when nothing recognisable was saved: what the guard would recognise,
  never a flag that was already given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from guard.errors import SupervisorError

__all__ = ["CHECKPOINT_FOLDER_RE", "OUTPUT_DIR_FLAGS", "check_reported_path", "holds_any_file",
           "is_plausible_output_dir", "nothing_found_hint", "output_dir_for_save", "output_dir_from_args",
           "output_dir_of_save"]

#: The job arguments that name its output folder, in order of preference.
OUTPUT_DIR_FLAGS = ("--output_dir", "--output-dir", "--out_dir", "--out-dir", "--save")


def output_dir_from_args(args: Sequence[str]) -> tuple[str, str] | None:
    """The output folder the job's own arguments name, and the flag that named it.

    Args:
        args: the job's arguments after the script (or the whole command for ``-- COMMAND``); scanning stops at a
            bare ``--``.

    Returns:
        ``(folder, flag)`` for the first flag of ``OUTPUT_DIR_FLAGS`` found (the last value when a flag repeats,
        as argparse does), or None. A flag without a value (last argument, or followed by another option) is
        ignored.
    """
    found: dict[str, str] = {}
    args = list(args)
    for i, token in enumerate(args):
        if token == "--":
            break
        flag, sep, value = token.partition("=")
        if flag not in OUTPUT_DIR_FLAGS:
            continue
        if not sep:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else ""
        if value:
            found[flag] = value
    for flag in OUTPUT_DIR_FLAGS:
        if flag in found:
            value = found[flag]
            if value.rstrip("/").endswith(_FILE_SUFFIXES):  # ``--save model.pt`` names a file: its folder
                value = os.path.dirname(value.rstrip("/")) or "."
            return value, flag
    return None


#: Names that are a file, not a folder, when a flag names them (``--save model.pt``, word_language_model's).
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".pkl")
#: A checkpoint folder of the layouts the guard knows; the folder above it is the output folder: the Trainer's
#: ``checkpoint-N`` (and ``tmp-checkpoint-N`` before its rename), accelerate's ``checkpoint_N`` (automatic naming,
#: under ``project_dir/checkpoints``), ``step_N`` and ``epoch_N`` (accelerate's ``complete_nlp_example.py`` and
#: transformers' ``run_*_no_trainer.py`` with ``--checkpointing_steps N`` or ``epoch``), DeepSpeed's ``global_stepN``,
#: Megatron-LM's ``iter_NNNNNNN`` (``megatron/training/checkpointing.py``: rank 0 ``torch.save``s its ``common.pt``
#: there first, the shards follow), torchtitan's ``step-N`` (``torchtitan/components/checkpoint.py``: a
#: ``torch.distributed.checkpoint`` set).
CHECKPOINT_FOLDER_RE = re.compile(r"(?:tmp-)?(?:checkpoint-|checkpoint_|step_|step-|epoch_|global_step|iter_)[0-9]+")


def output_dir_for_save(path: str | os.PathLike[str]) -> Path:
    """The output folder a saved file belongs to: the parent of the checkpoint-like folder that holds it (two
    levels up at most: ``out/checkpoint-20/model.pt`` -> ``out``, ``out/global_step5/mp_rank_00/x.pt`` -> ``out``),
    else the file's own folder (``out/ckpt.pt`` -> ``out``)."""
    where = Path(os.path.abspath(path))
    for folder in (where.parent, where.parent.parent):
        if CHECKPOINT_FOLDER_RE.fullmatch(folder.name):
            return folder.parent
    return where.parent


def output_dir_of_save(path: str | os.PathLike[str], *, cwd: str | os.PathLike[str] | None = None) -> Path | None:
    """The output folder the guard learns from a file the job saved (``output_dir_for_save``) when it may serve as
    one (``is_plausible_output_dir``), else None. The working folder is one only when the file lies in a checkpoint
    folder right in it: accelerate's examples default to ``--output_dir .`` and save ``./step_10/optimizer.bin``
    (the scan takes such folders whole; the final model is then only what the job saved at its top)."""
    where = Path(os.path.abspath(path))
    found = output_dir_for_save(where)
    if is_plausible_output_dir(found, cwd=cwd):
        return found
    here = Path(cwd or os.getcwd()).resolve()
    if found.resolve() == here and where.parent != found and CHECKPOINT_FOLDER_RE.fullmatch(where.parent.name):
        return found
    return None


def _forbidden(path: Path, cwd: Path) -> str | None:
    home = Path(os.path.expanduser("~")).resolve()
    if path == Path(path.anchor):
        return "the filesystem root"
    if path == home:
        return "the home folder"
    if path == cwd:
        return "the working folder"
    if cwd.is_relative_to(path):
        return "a folder above the working folder"
    return None


def is_plausible_output_dir(path: str | os.PathLike[str], *, cwd: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``path`` may serve as the output folder when the guard learns it from a file the job saved: not
    ``/``, the home folder, the working folder or a folder above it, nor a hidden folder (a cache)."""
    here = Path(cwd or os.getcwd()).resolve()
    where = (here / Path(path)).resolve()
    return _forbidden(where, here) is None and not any(part.startswith(".") for part in where.parts[1:])


def check_reported_path(path: str | os.PathLike[str] | None, *, output_dir: str | os.PathLike[str] | None,
                        cwd: str | os.PathLike[str] | None = None) -> Path:
    """Check a path from ``guard.checkpoint_saved(path)`` before anything is pushed from it.

    Args:
        path: what the job reported (absolute, or relative to ``cwd``).
        output_dir: the job's output folder when known; the path must be it or inside it.
        cwd: the job's working folder (default: this process's).

    Returns:
        The path, absolute and resolved.

    Raises:
        SupervisorError: an empty path, ``/``, the home folder, the working folder or one above it, or a path
            outside a known output folder. The message names the path; the hint says what to report.
    """
    hint = ("call guard.checkpoint_saved(path) with the checkpoint's own folder or file inside the output folder "
            "(--output-dir), e.g. guard.checkpoint_saved(f\"{out}/checkpoint-{step}\")")
    if path is None or not os.fspath(path).strip():
        raise SupervisorError("the job reported a checkpoint with an empty path: nothing secured from it", hint=hint)
    here = Path(cwd or os.getcwd()).resolve()
    where = (here / Path(os.fspath(path))).resolve()
    what = _forbidden(where, here)
    if what is not None:
        raise SupervisorError(f"the job reported {where} ({what}) as a checkpoint: the guard does not push it",
                              hint=hint)
    if output_dir is not None:
        base = (here / Path(output_dir)).resolve()
        if not (where == base or where.is_relative_to(base)):
            raise SupervisorError(f"the job reported checkpoint {where}, outside its output folder {base}: the "
                                  "guard does not push it", hint=hint)
    return where


def holds_any_file(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a folder holding a file anywhere below it (walks it: not for the loop)."""
    where = Path(folder)
    return where.is_dir() and any(path.is_file() for path in where.rglob("*"))


#: A job stopped with nothing saved that had trained at most this many steps spent its time starting up.
STARTED_ONLY_STEPS = 1


def nothing_found_hint(*, output_dir: str | None, destination_given: bool, holds_files: bool | None = None,
                       step: int | None = None) -> str:
    """The hint when no checkpoint could be secured because none was recognisable (or none was saved).

    Never names a flag that was already given: ``--push-to`` only without a destination, ``--output-dir`` only
    when no output folder is known; an output folder holding no file at all means the job never reached a save
    (its save format is not the cause then). ``holds_files``: whether the output folder holds any file, as looked
    at earlier off the loop (``holds_any_file``); None looks now. ``step``: the job's last training step (None: none
    seen); at most ``STARTED_ONLY_STEPS``, the time went to the job's start-up, not to steps between saves.
    """
    if not destination_given:
        return "no destination: pass --push-to DEST so that a checkpoint leaves the machine"
    recognised = ("call guard.checkpoint_saved(path) after each save, or save checkpoint-N folders (or *.pt, "
                  "*.safetensors files)")
    if output_dir is None:
        return f"no output folder known: pass --output-dir DIR (where the job saves), or {recognised}"
    if not (holds_any_file(output_dir) if holds_files is None else holds_files):
        if step is None or step <= STARTED_ONLY_STEPS:
            # TRL's sft at load 15-18 on 2 cores: its start-up took 60 s of a 60 s budget, stopped at step 1, and the
            # hint said to save more often
            trained = "no training step" if step is None else f"{step} training step{'s' if step != 1 else ''}"
            return (f"the job saved nothing in {output_dir} before it ended: it ran {trained}, its start-up (imports, "
                    "loading the model and data) took the time; give it a longer --timeout, or look at what its "
                    "start-up waits for")
        return (f"the job saved nothing in {output_dir} before it ended (it never reached a save): save a checkpoint "
                "more often (save_steps, or every N steps) so that one exists when the time runs out")
    return f"nothing in {output_dir} was recognisable as a complete checkpoint: {recognised} there"
