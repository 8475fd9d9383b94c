"""A Trainer job whose catch-all wrapper swallows a training error and exits 0 (--fail-at K), or whose callback
stops training early on purpose (--stop-at K, a legitimate early stop)."""

import argparse

from _tiny import Data, Tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=200)
parser.add_argument("--fail-at", type=int, default=0)
parser.add_argument("--stop-at", type=int, default=0)
parser.add_argument("--save-steps", type=int, default=0)
args = parser.parse_args()


class Trouble(TrainerCallback):
    def on_step_end(self, targs, state, control, **kwargs):
        if state.global_step == args.fail_at:
            try:
                raise OSError(28, "No space left on device")
            except OSError as exc:
                raise RuntimeError("could not write the metrics file") from exc
        if state.global_step == args.stop_at:
            control.should_training_stop = True  # early stopping, as EarlyStoppingCallback does


training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                                  save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                                  report_to="none", use_cpu=True, disable_tqdm=True,
                                  logging_steps=10)
try:
    Trainer(model=Tiny(), args=training_args, train_dataset=Data(1024), callbacks=[Trouble()]).train()
    print("training finished", flush=True)
except Exception as exc:  # the catch-all wrapper the issue describes
    print(f"training failed: {exc!r}; exiting anyway", flush=True)
