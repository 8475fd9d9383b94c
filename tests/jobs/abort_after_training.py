"""A Trainer job that trains --max-steps steps, saves its final model, then dies of SIGABRT at exit (as a C++
watchdog's abort at teardown does): os.abort() after trainer.train() returned."""

import argparse
import os
import sys

from _tiny import Data, Tiny
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--no-save", action="store_true")
args = parser.parse_args()

training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                                  save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=Tiny(), args=training_args, train_dataset=Data(256))
trainer.train()
if not args.no_save:
    trainer.save_model(args.output_dir)
print("[watchdog] terminate called: process group destroyed while a collective was pending", file=sys.stderr,
      flush=True)
os.abort()
