"""A plain loop shaped like nanoGPT's train.py: ``--key=value`` arguments, ``torch.save`` of a dict with
``iter_num`` into ``OUT_DIR/ckpt.pt`` every ``--eval_interval`` iterations; it never talks to the guard unless
``--api=True`` (then it answers checkpoint requests, but never reads ``guard.should_stop()``).
``--nan_at=N`` poisons the weights at iteration N (the loss is NaN from then on); ``--save_on_term=True`` saves
``ckpt.pt`` once more when SIGTERM arrives, as many loops do, whatever the weights hold by then (taking
``--term_save_s`` seconds first).

After the loop it prints ``training finished`` and writes ``OUT_DIR/final.pt``: the code after training that must
not run when the guard stopped the job.
"""

import os
import sys
import time

import torch

config = {"out_dir": "out", "max_iters": 100000, "eval_interval": 20, "step_s": 0.01, "api": "False",
          "ckpt_name": "ckpt.pt", "ready": "", "nan_at": 0, "save_on_term": "False",
          "term_save_s": 0.0}
for arg in sys.argv[1:]:
    key, _, value = arg[2:].partition("=")
    if key not in config:
        raise SystemExit(f"unknown option {arg}")
    config[key] = type(config[key])(value) if not isinstance(config[key], str) else value
api = config["api"] == "True"
if api:
    import guard

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
os.makedirs(config["out_dir"], exist_ok=True)


def save(iter_num):
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
    path = os.path.join(config["out_dir"], config["ckpt_name"])
    print(f"saving checkpoint to {path} at iter {iter_num}", flush=True)
    torch.save(checkpoint, path)
    return path


iter_num = 0
if config["save_on_term"] == "True":
    import signal

    def on_term(signum, frame):
        time.sleep(config["term_save_s"])  # a real model takes a while to save
        save(iter_num)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)

for iter_num in range(1, config["max_iters"] + 1):
    if iter_num == config["nan_at"]:
        with torch.no_grad():
            model.weight.fill_(float("nan"))
    x = torch.randn(8, 16)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {loss.item():.4f}", flush=True)
    if iter_num % config["eval_interval"] == 0:
        save(iter_num)
        if config["ready"] and iter_num >= 3 * config["eval_interval"]:
            open(config["ready"], "a").close()
    if api and guard.should_checkpoint():
        guard.checkpoint_saved(save(iter_num))
    time.sleep(config["step_s"])

print("training finished", flush=True)
torch.save(model.state_dict(), os.path.join(config["out_dir"], "final.pt"))
