"""Train a tiny byte-level GPT-2 with the ``transformers`` Trainer, from scratch, in well under a minute.

No pretrained weights, no tokenizer files, no network: the vocabulary is the 256 byte values plus one
token (id 256) that serves as end-of-text and padding. The model is built from a ``GPT2Config`` and
trained on ``examples/data/corpus.txt`` (prose written for this project, about 135 KB). The script is
a plain Trainer script and knows nothing about the guard; run it either way::

    python examples/train_tiny.py
    python -m guard examples/train_tiny.py --max-steps 300

On 2 CPU cores the default 200 steps take about 20 s (25 s with start-up) and the logged training loss
falls from about 5.5 (uniform over 257 tokens is ln 257 = 5.55) to about 1.3. The Trainer picks the
device itself (it needs ``accelerate``, as every Trainer does), so the same command uses a GPU when
there is one. Checkpoints go to ``OUTPUT_DIR/checkpoint-<step>/`` every ``--save-steps`` steps; the
final model (``config.json`` and ``model.safetensors``) goes to the output folder itself, and is
pushed to ``--hub-model-id`` with ``--push-to-hub``. ``--resume last`` (or a checkpoint path)
continues a stopped run.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
BYTE_VOCAB_SIZE = 256
EOS_TOKEN_ID = 256  # the one extra token: end of text, also used as padding
VOCAB_SIZE = BYTE_VOCAB_SIZE + 1
EVAL_FRACTION = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a tiny byte-level GPT-2 with the transformers Trainer.")
    add = parser.add_argument
    add("--output-dir", default="out/tiny", help="checkpoints and the final model go here (default: %(default)s)")
    add("--max-steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    add("--save-steps", type=int, default=50, help="save a checkpoint every N steps (default: %(default)s)")
    add("--save-total-limit", type=int, default=3, help="keep at most N checkpoints (default: %(default)s)")
    add("--logging-steps", type=int, default=10, help="log the loss every N steps (default: %(default)s)")
    add("--seed", type=int, default=42, help="random seed (default: %(default)s)")
    add("--batch-size", type=int, default=16, help="sequences per step and device (default: %(default)s)")
    add("--block-size", type=int, default=128, help="bytes per training sequence (default: %(default)s)")
    add("--learning-rate", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    add("--push-to-hub", action="store_true", help="push checkpoints and the final model to the Hub")
    add("--hub-model-id", default=None, help="Hub repo NS/NAME for --push-to-hub (default: the output folder's name)")
    add("--report-to", default="none", help='trackers, as TrainingArguments.report_to (default: "%(default)s")')
    add(
        "--resume",
        default=None,
        metavar="PATH",
        help='resume from this checkpoint folder, or "last" for the newest checkpoint in --output-dir',
    )
    add("--sample-bytes", type=int, default=80, help="bytes to generate at the end; 0 for none (default: %(default)s)")
    return parser.parse_args(argv)


def load_blocks(block_size: int) -> list[list[int]]:
    """Cut the corpus into consecutive, non-overlapping blocks of ``block_size`` byte ids."""
    data = CORPUS_PATH.read_bytes()
    return [list(data[start : start + block_size]) for start in range(0, len(data) - block_size + 1, block_size)]


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Stack equal-length blocks; the labels are the inputs (GPT-2 shifts them inside the model)."""
    input_ids = torch.tensor([example["input_ids"] for example in examples], dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def build_model(block_size: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=block_size,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )
    return GPT2LMHeadModel(config)


@torch.no_grad()
def sample(model: GPT2LMHeadModel, prompt: str, num_bytes: int) -> str:
    """Greedy continuation of ``prompt``, decoded as UTF-8 (invalid bytes replaced)."""
    model.eval()
    ids = list(prompt.encode("utf-8"))
    window = model.config.n_positions
    for _ in range(num_bytes):
        input_ids = torch.tensor([ids[-window:]], dtype=torch.long, device=model.device)
        next_id = int(model(input_ids=input_ids).logits[0, -1].argmax())
        if next_id == EOS_TOKEN_ID:
            break
        ids.append(next_id)
    return bytes(ids).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_seed(args.seed)

    blocks = load_blocks(args.block_size)
    eval_count = max(1, int(len(blocks) * EVAL_FRACTION))
    train_dataset = Dataset.from_dict({"input_ids": blocks[:-eval_count]})
    eval_dataset = Dataset.from_dict({"input_ids": blocks[-eval_count:]})
    model = build_model(args.block_size)
    print(
        f"corpus: {CORPUS_PATH.name}, {len(train_dataset)} train / {len(eval_dataset)} eval blocks of "
        f"{args.block_size} bytes; model: {model.num_parameters():,} parameters",
        flush=True,
    )

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(20, args.max_steps // 10),
        weight_decay=0.01,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        eval_strategy="no",
        seed=args.seed,
        report_to=args.report_to,
        push_to_hub=args.push_to_hub,
        hub_model_id=args.hub_model_id,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        data_collator=collate,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )

    resume: str | bool | None = args.resume
    if resume == "last":
        resume = True  # the Trainer looks for the newest checkpoint-* in output_dir
    trainer.train(resume_from_checkpoint=resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model()  # final model into output_dir; pushes too when --push-to-hub

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if losses:
        print(f"first loss: {losses[0]:.4f}  last loss: {losses[-1]:.4f}  ({len(losses)} logged)", flush=True)
    print(f"eval loss: {eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f} per byte)", flush=True)
    if args.sample_bytes > 0:
        print(f"sample: {sample(trainer.model, 'The lamp ', args.sample_bytes)!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
