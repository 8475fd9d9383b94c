"""A slow transformers Trainer job (--step-s per step) that saves every --save-steps into --output-dir."""

import argparse
import time

from _tiny import Data, Tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=10000)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--save-steps", type=int, default=50)
parser.add_argument("--push-to-hub", action="store_true")
parser.add_argument("--hub-model-id")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--accum", type=int, default=1)  # gradient_accumulation_steps
parser.add_argument("--logging-steps", type=int, default=10)
args = parser.parse_args()


class Slow(TrainerCallback):
    steps_this_run = 0

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"train_begin global_step={state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        Slow.steps_this_run += 1
        time.sleep(ARGS_STEP_S)


ARGS_STEP_S = args.step_s
training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
    logging_steps=args.logging_steps, gradient_accumulation_steps=args.accum,
    save_strategy="steps", save_steps=args.save_steps, report_to="none", learning_rate=1e-2, use_cpu=True,
    disable_tqdm=True, push_to_hub=args.push_to_hub, hub_model_id=args.hub_model_id, seed=0,
)
trainer = Trainer(model=Tiny(), args=training_args, train_dataset=Data(4096), callbacks=[Slow()])
out = trainer.train(resume_from_checkpoint=True if args.resume else None)
print(f"trainer finished at step {out.global_step}; steps_this_run={Slow.steps_this_run}", flush=True)
trainer.save_model()
