"""The supervisor <-> agent contract: environment variables, the channel, the messages.

The supervisor creates a Unix ``SOCK_SEQPACKET`` socket in a private temporary folder and names it in
``GUARD_AGENT_SOCKET``. Every Python process of the job loads the agent at start-up (``guard/inside/_site`` is put
first on ``PYTHONPATH``; its ``sitecustomize`` chains to any other ``sitecustomize``), and an agent connects
the first time it has something to say. One datagram is one message: a UTF-8 JSON object with a ``"t"`` (type)
key. ``SOCK_SEQPACKET`` keeps message boundaries and makes each send all-or-nothing, so the agent can send
without blocking and simply drop a message when the socket is full: a dead or slow supervisor never blocks the
job, and a dead or silent agent never blocks the supervisor (it only reads what arrives).

Agent -> supervisor (``t``):

``hello``           pid, argv, rank, local_rank, world_size, node_rank, error_file (TORCHELASTIC_ERROR_FILE)
``dist``            store (bool), global_rank, world_size: ``torch.distributed`` is up (the cross-rank relay)
``step``            step (int), loss (float|None), finite (bool), source (``trainer``|``backward``|``report``),
                    n (steps covered by this message, >= 1), skipped (optimizer steps a GradScaler skipped in a
                    row; only with a GradScaler)
``trainer_config``  the TrainingArguments that matter (see ``TRAINER_FIELDS``) + has_eval_dataset, max_steps,
                    checkpoint_bytes_estimate (weights + AdamW state, from tensor metadata);
                    the agent then waits up to ack_timeout_s for ``ack`` (go on) before the first step
``training_args``   the same fields as ``trainer_config`` (no max_steps, no has_eval_dataset), sent when
                    ``TrainingArguments`` is built (before the job's data work); the agent waits for ``ack``
``checkpoint_saved`` path, step, save_s, requested, zero (from the world's process zero), hook (``"dcp"``: seen at a
                    ``torch.distributed.checkpoint.save``, not reported by the job)
``file_saved``      path (absolute), step (the agent's step count), save_s: ``torch.save`` to a named file returned;
                    size, mtime_ns, inode: the file's signature right after the save (absent when it cannot be read)
``api``             name: the script called ``guard.<name>()`` for the first time (``should_checkpoint``,
                    ``checkpoint_saved``, ``should_stop``)
``exception``       exc_type, message, root (the job's uncaught exception, from ``sys.excepthook``)
``push_result``     ok (bool), error (str|None), count: pushes the Trainer did in the background
``train_end``       step, max_steps, stopped (a callback or the guard asked training to stop)
``train_error``     exc_type, message, root, step, max_steps: ``Trainer.train()`` raised (the script may catch it)
``train_intent``    what (``optimizer``, with type: an optimizer was built; ``optimizer_step``: it stepped), once each
``empty_loader``    samples, batch_size, drop_last: a DataLoader with no batch at all was iterated (once)
``watching``        what (``torch``): the agent hooked torch and sees the losses; printed losses stop deciding
``progress``        begun, step, where (the main thread's stack in one line): the answer to ``dump``; to ``stop``
                    without where (the last step counted, for the VERDICT's step=)
``count``           step: the agent's step count, sent from its flusher thread every 0.1 s while it moves (no loss,
                    nothing read from the device): the VERDICT's step= when a signal kills the job between two reads
``relayed``         signal, origin, at_step: this rank adopted, from the job's store, a checkpoint request another
                    node's guard sent for a termination signal it received (``origin``: that node)
``replay``          n: CUDA-graph replays since the last such message (sent every ``check_every``); progress without
                    a loss (a replayed step calls no ``.backward()``), so not a stall

Supervisor -> agent (``t``):

``ack``             go on (after ``trainer_config`` or ``training_args``)
``checkpoint``      save a checkpoint now (at the next step end); ``stop`` (bool): then end training; ``at_step``
                    (several ranks): save at that step, so that every rank saves at the same one; ``origin``,
                    ``signal`` (a node other than 0 that received a termination signal): published to every rank
``stop``            end training cleanly at the next step end
``dump``            print every thread's stack, answer ``progress`` (the job looks hung)

Saved weights, judged alike by the agent (the tensors of a ``torch.save``) and the guard (the bytes of a
safetensors file or a ``torch.save`` zip): a floating tensor holding a NaN or a +inf is not finite; one holding a
-inf is not finite either, unless its name says it is a mask (``mask_allows_minus_inf``: an additive attention
mask kept as a buffer, ``register_buffer("mask", torch.full((T, T), -inf).triu(1))``, holds -inf by design).
Weights that blow up give NaN and +inf (a tiny MLP at a learning rate of 1e6 and 1e12, SGD and Adam: every save
with a -inf in a parameter also held a NaN or a +inf), so the exception loses no fault seen.
"""

from __future__ import annotations

import json

#: ``typing.TYPE_CHECKING`` without importing ``typing``: this module and the agent's load in every Python
#: process of a job at its start, and ``typing`` is 4-5 ms of it (``-X importtime``); type checkers take any
#: name ``TYPE_CHECKING`` as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ENV_CHECK_EVERY",
    "ENV_RESUME_PATH",
    "ENV_RESUME_STEP",
    "ENV_RUN_ID",
    "ENV_SANITY_STEPS",
    "ENV_SOCKET",
    "MAX_MESSAGE_BYTES",
    "TRAINER_FIELDS",
    "decode",
    "encode",
    "mask_allows_minus_inf",
]

#: Path of the supervisor's Unix socket; unset means "no supervisor": every agent call is a no-op.
ENV_SOCKET = "GUARD_AGENT_SOCKET"
#: How many first steps are checked one by one (each read from the device).
ENV_SANITY_STEPS = "GUARD_AGENT_SANITY_STEPS"
#: After the sanity pass, read the accumulated loss from the device every N steps (no sync per step).
ENV_CHECK_EVERY = "GUARD_AGENT_CHECK_EVERY"
#: A checkpoint folder the job should resume from (set by ``--resume``).
ENV_RESUME_PATH = "GUARD_AGENT_RESUME_PATH"
#: The training step of that checkpoint: a plain loop's ``.backward()`` count continues from it.
ENV_RESUME_STEP = "GUARD_AGENT_RESUME_STEP"
#: Many nodes: this node's guard's run id. Global rank 0 (on node 0) puts node 0's in the job's store; the other
#: nodes' agents tell their guard when it differs from theirs (``guard.inside.agent._dist``).
ENV_RUN_ID = "GUARD_AGENT_RUN_ID"
#: The folder holding the ``guard`` package (informational: the agent's ``sitecustomize`` finds the package from its
#: own location and loads it under a private name, see ``guard.PRIVATE_NAME``).

MAX_MESSAGE_BYTES = 64 * 1024

#: TrainingArguments fields the agent reports (later stages read them: push, save, eval, trackers).
TRAINER_FIELDS = (
    "output_dir",
    "push_to_hub",
    "hub_model_id",
    "hub_strategy",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "report_to",
    "bf16",
    "fp16",
    "torch_compile",
    "gradient_checkpointing",
    "max_steps",
    "logging_nan_inf_filter",
    "project",
    "run_name",
    "trackio_space_id",
)


def encode(message: dict[str, Any]) -> bytes:
    """One message as a datagram (compact JSON, UTF-8); NaN and infinities travel as ``NaN``/``Infinity``."""
    return json.dumps(message, separators=(",", ":"), default=str, allow_nan=True).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    """Parse one datagram; None for anything that is not a JSON object with a string ``t``."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(message, dict) and isinstance(message.get("t"), str):
        return message
    return None


def mask_allows_minus_inf(name: str) -> bool:
    """Whether the saved tensor ``name`` (its keys joined by dots: ``model.h.0.attn.mask``) may hold -inf: its last
    part ends in ``mask``, any case (``mask``, ``attn_mask``, ``causal_mask``; not ``mask_token``, a trained
    embedding). A NaN or a +inf is never allowed."""
    return name.rpartition(".")[2].lower().endswith("mask")
