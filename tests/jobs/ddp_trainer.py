"""A transformers Trainer under torchrun on the CPU (gloo): slow steps, checkpoints in --output-dir.

--slow-part STEP --slow-part-s S --ready FILE: rank 1 writes its part of checkpoint-STEP (rng_state_1.pth) S
seconds late, after creating FILE; rank 0's part (the model, trainer_state.json) is written meanwhile."""

import argparse
import time

from _tiny import Data, Tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=10000)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--save-steps", type=int, default=1000)
parser.add_argument("--slow-part", type=int, default=-1)
parser.add_argument("--slow-part-s", type=float, default=0.0)
parser.add_argument("--ready")
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
save_rng_state = trainer._save_rng_state


def slow_rng_state(output_dir):
    if args_.process_index == 1 and trainer.state.global_step == args.slow_part:
        print(f"rank 1: writing its part of checkpoint-{args.slow_part} {args.slow_part_s:g}s late", flush=True)
        if args.ready:
            open(args.ready, "w").close()
        time.sleep(args.slow_part_s)
    save_rng_state(output_dir)
    if args_.process_index == 1 and trainer.state.global_step == args.slow_part:
        print(f"rank 1: its part of checkpoint-{args.slow_part} written", flush=True)


args_ = training_args
trainer._save_rng_state = slow_rng_state
trainer.train()
trainer.save_model()
