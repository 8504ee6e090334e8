"""A small character-level GPT on generated text, the GPU path: bf16 autocast, fused AdamW, pinned memory, async copies.

    gpuflow run experiments/chargpt-gpu.yaml     # one H100 through SkyPilot
    gpuflow run experiments/chargpt-cpu.yaml     # a tiny one on this machine's CPU
    python benchmarks/gpu_throughput.py          # the same model and batch: bare torch against train_epoch

The model, the data and `train_epoch` are plain torch, so that the benchmark runs them where only torch is
installed; `train_loop` puts Ray Train and gpuflow.cluster.loop around them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gpuflow.cluster.telemetry import StepTimer

# the text is lowercase words, spaces, full stops and newlines; 32 ids leave room and keep matmuls aligned
ALPHABET = "\n .abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 32
NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split()
)


def make_text(sentences: int, seed: int = 0) -> list[str]:
    """Sums in words, e.g. 'three plus four is seven.': a next character worth predicting, at any size."""
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 11, (sentences, 2), generator=generator).tolist()
    return [f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}." for a, b in pairs]


def encode(lines: list[str]) -> torch.Tensor:
    ids = {char: index for index, char in enumerate(ALPHABET)}
    return torch.tensor([ids[char] for char in "\n".join(lines) + "\n"], dtype=torch.long)


def write_parquet(train_uri: str, validation_uri: str) -> None:
    """One generated sentence per row; the validation sentences come from another seed."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    for uri, sentences, seed in ((train_uri, 40_000, 0), (validation_uri, 2_000, 1)):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": make_text(sentences, seed)}), uri)


def windows(tokens: torch.Tensor, block_size: int) -> torch.utils.data.TensorDataset:
    """Non-overlapping (input, next-character target) windows of block_size characters."""
    count = (len(tokens) - 1) // block_size
    inputs = tokens[: count * block_size].view(count, block_size)
    targets = tokens[1 : count * block_size + 1].view(count, block_size)
    return torch.utils.data.TensorDataset(inputs, targets)


def batches(dataset, batch_size: int, device: torch.device, sampler=None) -> torch.utils.data.DataLoader:
    # pinned host memory lets .to(device, non_blocking=True) overlap the copy with the previous step's kernels
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=True,
        pin_memory=device.type == "cuda",
    )


@dataclass
class GPTConfig:
    block_size: int = 256  # characters of context
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384  # a multiple of 64 per head keeps the flash-attention kernels usable
    vocab_size: int = VOCAB_SIZE


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        # flash attention on GPUs that have it; is_causal masks the future without building a mask
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).contiguous().view(batch, time, channels))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one matrix reads and writes characters
        self.apply(self._init)
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):  # residual outputs, GPT-2's scaling
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.token_embedding(ids) + self.position_embedding(positions))
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def flops_per_token(self) -> float:
        """6·N for the weights (N without the position table, which does no matmul) plus attention's 12·L·d·T."""
        weights = sum(p.numel() for p in self.parameters()) - self.position_embedding.weight.numel()
        config = self.config
        return 6 * weights + 12 * config.n_layer * config.n_embd * config.block_size


def make_optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel for all parameters); no weight decay on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )


def autocast(precision: str, device: torch.device):
    """fp32 as is; bf16/fp16 matmuls under autocast (fp16 also needs a GradScaler: see train_epoch)."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=precision in ("bf16", "fp16"))


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    device: torch.device,
    precision: str,
    timer: StepTimer,
    scaler: torch.amp.GradScaler | None = None,
    after_step=None,
    resumed: tuple[int, float] = (0, 0.0),
) -> float:
    """One pass over the loader; returns the mean training loss. fp16 needs a scaler; bf16 has fp32's range.
    `after_step(steps, total_loss)` runs after each step; `resumed`: the (steps, summed loss) the epoch had already."""
    model.train()
    total, steps = torch.full((), resumed[1], device=device), resumed[0]
    for inputs, targets in timer.steps(loader):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast(precision, device):
            loss = model(inputs, targets)
        if scaler is not None and scaler.is_enabled():
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # summed on the device: loss.item() each step would wait for the GPU (a CPU-GPU sync point)
        total += loss.detach()
        steps += 1
        if after_step is not None:
            after_step(steps, total)
    return (total / max(steps, 1)).item()


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, precision: str) -> dict[str, float]:
    model.eval()
    loss, correct, count = 0.0, 0, 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(precision, device):
            logits = model(inputs)
        loss += F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += targets.numel()
    return {"val_loss": loss / max(count, 1), "val_char_accuracy": correct / max(count, 1)}


def model_config(config: dict) -> GPTConfig:
    return GPTConfig(**{key: config[key] for key in ("block_size", "n_layer", "n_head", "n_embd") if key in config})


def train_loop(config: dict) -> None:
    """The Ray Train per-worker loop: train_epoch inside DDP, with telemetry, checkpoints and MLflow through
    gpuflow.cluster.loop."""
    import ray.train
    import ray.train.torch

    from gpuflow.cluster import loop

    device = ray.train.torch.get_device()
    gpt_config = model_config(config)
    world_size = ray.train.get_context().get_world_size()

    # data: the whole text in memory (a few MB), cut into windows; each rank reads its share
    train_set = windows(encode(loop.read_table(config["train_path"]).column("text").to_pylist()), gpt_config.block_size)
    validation_set = windows(
        encode(loop.read_table(config["validation_path"]).column("text").to_pylist()), gpt_config.block_size
    )
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True) if world_size > 1 else None
    train_batches = batches(train_set, config["batch_size"], device, sampler)
    validation_batches = torch.utils.data.DataLoader(
        validation_set, batch_size=config["batch_size"], pin_memory=device.type == "cuda"
    )

    # model, optimizer
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(gpt_config))
    optimizer = make_optimizer(model, config["lr"], device)
    scaler = loop.grad_scaler(config["precision"], device)
    start_epoch = loop.restore(model, optimizer, scaler)
    timer = loop.telemetry(
        config,
        flops_per_sample=loop.unwrap(model).flops_per_token() * gpt_config.block_size,
        tokens_per_sample=gpt_config.block_size,
    )

    for epoch in range(start_epoch, config["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)
        # steps_per_epoch (optional) caps an epoch: a short run on a CPU, or more frequent reports
        done = loop.resumed_within(epoch)  # this epoch's steps before a preemption (their checkpoint), if any
        epoch_batches = itertools.islice(train_batches, done.get("step", 0), config.get("steps_per_epoch"))

        def on_notice(steps, total, epoch=epoch):  # a node has its spot notice: a checkpoint each step until it goes
            if loop.preempted():
                loop.report_preempted(epoch, steps, model, optimizer, scaler, loss=total.item())

        train_loss = train_epoch(
            model,
            optimizer,
            epoch_batches,
            device,
            config["precision"],
            timer,
            scaler,
            on_notice,
            resumed=(done.get("step", 0), done.get("loss", 0.0)),
        )
        figures = timer.end_epoch()
        metrics = {"train_loss": train_loss, **evaluate(model, validation_batches, device, config["precision"])}
        loop.report(epoch, {**metrics, **figures}, model, optimizer, scaler)

    timer.close()
    loop.log_model(model, input_example=validation_set.tensors[0][:2].numpy())
