"""A Trainer job that trains --max-steps steps, then hangs in its own final upload (a call that never returns)."""

import argparse
import threading

from _tiny import Data, Tiny
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=6)
args = parser.parse_args()


def upload_results(folder):
    print(f"uploading {folder} ...", flush=True)
    threading.Event().wait()  # a connection that never answers


training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                                  save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
Trainer(model=Tiny(), args=training_args, train_dataset=Data(256)).train()
upload_results(args.output_dir)
