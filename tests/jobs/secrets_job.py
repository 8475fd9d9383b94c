"""Prints MY_API_TOKEN's value and an hf_ token, each split across two writes."""

import os
import sys
import time

secret = os.environ["MY_API_TOKEN"]
token = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEFGH"
print(f"the secret is {secret} in full", flush=True)
sys.stdout.write("split: " + secret[:5])
sys.stdout.flush()
time.sleep(0.3)
sys.stdout.write(secret[5:] + " end\n")
sys.stdout.write("hub " + token[:10])
sys.stdout.flush()
time.sleep(0.3)
sys.stdout.write(token[10:] + " end\n")
sys.stdout.flush()
print(f"err {secret}", file=sys.stderr, flush=True)
