"""Train a tiny byte-level GRU language model with a plain PyTorch loop, and talk to the guard.

The same corpus and the same byte-level idea as ``train_tiny.py`` (every byte is a token, so no
tokenizer), but no ``transformers``: a hand-written loop with ``loss.backward()`` and an optimizer
step. Run it plain or under the guard::

    python examples/train_loop.py
    python -m guard --timeout 10m examples/train_loop.py --steps 2000

It uses the optional guard API the documented way: the import may fail (jobguard not installed) and
every call is a cheap no-op when no guard supervises the run. When the guard asks for a checkpoint the
loop writes one at once and reports its folder; when the guard asks the job to stop the loop ends
cleanly; on start it resumes from the checkpoint the guard names, if any (``--resume PATH`` wins).

A checkpoint is the folder ``OUTPUT_DIR/checkpoint-<step>/`` holding ``model.pt`` (the model's
``state_dict``), ``optimizer.pt`` (the optimizer's ``state_dict``), ``rng.pt`` (the batch sampler's
and torch's random state, so a resumed run draws the same batches) and ``guard_checkpoint.json``
(``{"step": N}``, N the number of optimizer steps done). Each is written to a hidden temporary folder
and renamed into place, so a ``checkpoint-*`` folder is always complete. A run that finishes writes
the final ``model.pt`` and ``config.json`` into ``OUTPUT_DIR`` itself.

On 2 CPU cores the default 200 steps take about 20 s (with start-up) and the printed loss falls from about
ln 256 = 5.55 to under 0.5.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

try:
    import guard
except ImportError:  # running without jobguard installed
    guard = None

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
VOCAB_SIZE = 256  # one token per byte value
EVAL_FRACTION = 0.05
EVAL_BATCHES = 4
CHECKPOINT_MARKER = "guard_checkpoint.json"


class ByteGRU(nn.Module):
    """Embedding -> GRU -> linear head over the 256 byte values.

    ``forward`` takes byte ids of shape ``(batch, time)`` (int64) and returns logits of shape
    ``(batch, time, 256)``.
    """

    def __init__(self, embed_dim: int = 64, hidden_dim: int = 256, num_layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, embed_dim)
        self.gru = nn.GRU(embed_dim, hidden_dim, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_dim, VOCAB_SIZE)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states, _ = self.gru(self.embed(input_ids))
        return self.head(hidden_states)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a tiny byte-level GRU LM with a plain PyTorch loop.")
    add = parser.add_argument
    add("--output-dir", default="out/loop", help="checkpoints and the final model go here (default: %(default)s)")
    add("--steps", type=int, default=200, help="optimizer steps in all, resumed ones included (default: %(default)s)")
    add("--save-every", type=int, default=100, help="save a checkpoint every N steps; 0: never (default: %(default)s)")
    add("--log-every", type=int, default=10, help="print the mean loss every N steps (default: %(default)s)")
    add("--batch-size", type=int, default=32, help="sequences per step (default: %(default)s)")
    add("--seq-len", type=int, default=128, help="bytes per training sequence (default: %(default)s)")
    add("--lr", type=float, default=3e-3, help="Adam learning rate (default: %(default)s)")
    add("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    add("--resume", default=None, metavar="PATH", help="checkpoint folder to resume from (default: the guard's)")
    add("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add("--sample-bytes", type=int, default=80, help="bytes to generate at the end; 0 for none (default: %(default)s)")
    return parser.parse_args(argv)


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Return the corpus bytes as int64 tensors ``(train, eval)``; eval is the last 5 %."""
    data = torch.tensor(list(CORPUS_PATH.read_bytes()), dtype=torch.long)
    split = int(len(data) * (1 - EVAL_FRACTION))
    return data[:split], data[split:]


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Draw ``batch_size`` random windows of ``seq_len + 1`` bytes: shape ``(batch_size, seq_len + 1)``."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([data[start : start + seq_len + 1] for start in starts.tolist()])


def lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``windows`` (``(batch, time + 1)``), a 0-d tensor."""
    logits = model(windows[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), windows[:, 1:].reshape(-1))


def save_checkpoint(
    output_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator
) -> Path:
    """Write ``output_dir/checkpoint-<step>/`` atomically (temporary folder, then rename); return it."""
    final = output_dir / f"checkpoint-{step}"
    partial = output_dir / f".partial-checkpoint-{step}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save(model.state_dict(), partial / "model.pt")
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    torch.save({"generator": generator.get_state(), "torch": torch.get_rng_state()}, partial / "rng.pt")
    (partial / CHECKPOINT_MARKER).write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, device: torch.device
) -> int:
    """Load a folder written by ``save_checkpoint`` into the given objects; return its step."""
    model.load_state_dict(torch.load(path / "model.pt", map_location=device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device))
    rng = torch.load(path / "rng.pt")
    generator.set_state(rng["generator"])
    torch.set_rng_state(rng["torch"])
    return int(json.loads((path / CHECKPOINT_MARKER).read_text(encoding="utf-8"))["step"])


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, seq_len: int, device: torch.device) -> float:
    """Mean loss over a fixed set of eval windows (its own seeded generator, so runs compare)."""
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(EVAL_BATCHES):
        losses.append(float(lm_loss(model, sample_batch(data, batch_size, seq_len, generator).to(device))))
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model: ByteGRU, prompt: str, num_bytes: int, device: torch.device) -> str:
    """Greedy continuation of ``prompt``, decoded as UTF-8 (invalid bytes replaced)."""
    model.eval()
    ids = list(prompt.encode("utf-8"))
    hidden_states, state = model.gru(model.embed(torch.tensor([ids], device=device)))
    for _ in range(num_bytes):
        next_id = int(model.head(hidden_states[0, -1]).argmax())
        ids.append(next_id)
        hidden_states, state = model.gru(model.embed(torch.tensor([[next_id]], device=device)), state)
    model.train()
    return bytes(ids).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    output_dir = Path(args.output_dir)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    train_data, eval_data = load_corpus()
    model = ByteGRU().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(
        f"corpus: {CORPUS_PATH.name}, {len(train_data)} train / {len(eval_data)} eval bytes; "
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters on {device}",
        flush=True,
    )

    resume = args.resume
    if resume is None and guard:
        resume = guard.resume_path()  # None when there is nothing to resume from
    start_step = 0
    if resume:
        start_step = load_checkpoint(Path(resume), model, optimizer, generator, device)
        print(f"resumed from {resume} at step {start_step}", flush=True)

    step = start_step
    last_saved_step = start_step if resume else None
    logged: list[tuple[int, float]] = []
    window_losses: list[float] = []
    stopped_early = False
    started_s = time.monotonic()
    for step in range(start_step + 1, args.steps + 1):
        windows = sample_batch(train_data, args.batch_size, args.seq_len, generator).to(device)
        loss = lm_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        window_losses.append(loss.item())
        if step == start_step + 1 or step % args.log_every == 0 or step == args.steps:
            mean_loss = sum(window_losses) / len(window_losses)
            logged.append((step, mean_loss))
            window_losses = []
            print(f"step={step} loss={mean_loss:.4f} elapsed_s={time.monotonic() - started_s:.1f}", flush=True)

        periodic = args.save_every > 0 and step % args.save_every == 0
        requested = bool(guard and guard.should_checkpoint())  # asked every step, so a request never waits
        if periodic or requested:
            path = save_checkpoint(output_dir, step, model, optimizer, generator)
            last_saved_step = step
            print(f"saved {path}", flush=True)
            if guard:
                guard.checkpoint_saved(path)
        if guard and guard.should_stop():
            stopped_early = True
            saved = f"step {last_saved_step}" if last_saved_step is not None else "none"
            print(f"stopping at step {step}: the guard asked (last checkpoint: {saved})", flush=True)
            break

    if window_losses:  # steps since the last printed loss (a stop between two log steps)
        logged.append((step, sum(window_losses) / len(window_losses)))
    if logged:
        (first_step, first_loss), (last_step, last_loss) = logged[0], logged[-1]
        print(
            f"first loss: {first_loss:.4f} (step {first_step})  last loss: {last_loss:.4f} (step {last_step})",
            flush=True,
        )
    if stopped_early:
        return 0
    eval_loss = evaluate(model, eval_data, args.batch_size, args.seq_len, device)
    print(f"eval loss: {eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f} per byte)", flush=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), output_dir / "model.pt")
    config = {"model": "ByteGRU", "vocab_size": VOCAB_SIZE, "steps": step, "seq_len": args.seq_len}
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if args.sample_bytes > 0:
        print(f"sample: {generate(model, 'The lamp ', args.sample_bytes, device)!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
