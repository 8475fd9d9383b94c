"""A transformers Trainer whose loss turns NaN at --nan-at (its own log shows the filtered loss, not NaN)."""

import argparse

import torch
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--max-steps", type=int, default=20)
parser.add_argument("--output-dir", default="out")
parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
args = parser.parse_args()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x, labels=None):
        self.calls += 1
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)
        if self.calls == args.nan_at:
            loss = loss * float("nan")
        return {"loss": loss}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return {"x": x, "labels": x.sum()}


training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, logging_steps=1,
    save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to="none",
    learning_rate=1e-2, use_cpu=True, disable_tqdm=True,
)
Trainer(model=Tiny(), args=training_args, train_dataset=Data()).train()
print("trainer finished", flush=True)
