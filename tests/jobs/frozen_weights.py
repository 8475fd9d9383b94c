"""A plain loop whose optimizer holds copies of the parameters (visual_prompting #7): the model never changes, the
loss is the same every step, and the run ends 0."""

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD([p.detach().clone().requires_grad_() for p in model.parameters()], lr=0.1)
x, y = torch.ones(8, 4), torch.zeros(8, 1)
for step in range(30):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
