"""A transformers Trainer under torchrun on the CPU (gloo): slow steps, checkpoints in --output-dir."""

import argparse
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=10000)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--save-steps", type=int, default=1000)
args = parser.parse_args()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 100000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        return {"x": x, "labels": x.sum()}


class Slow(TrainerCallback):
    def on_step_end(self, args_, state, control, **kwargs):
        time.sleep(args.step_s)

    def on_save(self, args_, state, control, **kwargs):
        print(f"rank {args_.process_index}: saved at step {state.global_step}", flush=True)


training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4, logging_steps=10,
    save_strategy="steps", save_steps=args.save_steps, report_to="none", use_cpu=True, ddp_backend="gloo",
    disable_tqdm=True, dataloader_num_workers=0,
)
trainer = Trainer(model=Tiny(), args=training_args, train_dataset=Data(), callbacks=[Slow()])
trainer.train()
trainer.save_model()
