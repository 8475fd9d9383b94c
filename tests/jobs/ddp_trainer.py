"""A transformers Trainer under torchrun on the CPU (gloo): slow steps, checkpoints in --output-dir."""

import argparse
import time

from _tiny import Data, Tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=10000)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--save-steps", type=int, default=1000)
args = parser.parse_args()


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
trainer = Trainer(model=Tiny(), args=training_args, train_dataset=Data(100000), callbacks=[Slow()])
trainer.train()
trainer.save_model()
