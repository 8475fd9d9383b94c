"""A DataLoader with a worker process whose batches (4 MiB each) travel through /dev/shm (too small in the test)."""

import torch


class Big(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.randn(1024, 1024)


loader = torch.utils.data.DataLoader(Big(), batch_size=1, num_workers=1)
for step, batch in enumerate(loader, start=1):
    print(f"batch {step}: {tuple(batch.shape)}", flush=True)
