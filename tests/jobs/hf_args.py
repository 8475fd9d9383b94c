"""run_clm.py's shape: TrainingArguments from HfArgumentParser, then slow data work, then the Trainer; a push only
when --push_to_hub is given."""

import sys
import time

from _tiny import Data, Tiny
from transformers import HfArgumentParser, Trainer, TrainingArguments

parser = HfArgumentParser((TrainingArguments,))
if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
    (training_args,) = parser.parse_json_file(json_file=sys.argv[1])
else:
    (training_args,) = parser.parse_args_into_dataclasses()
print("data work started", flush=True)
time.sleep(20)  # tokenizing a corpus
print("data work done", flush=True)
trainer = Trainer(model=Tiny(), args=training_args, train_dataset=Data(64))
trainer.train()
if training_args.push_to_hub:
    trainer.push_to_hub()
