"""GPU reference step times for the bench's GPU-dilated cells (issue 10, "Clean cells").

    python3 scripts/gpu_step_reference.py --out gpu_steps.json        (on a machine with a CUDA GPU)

The time-dilated mode of ``hgsgc bench`` (``dilation: gpu``) needs "a GPU's step for the same
model and batch". TensorFlow with CUDA cannot be installed on the GPU machine lent to this project
(no package registry there; the wheel is far above what can be carried), so this script rebuilds
hgsgc's models layer for layer in PyTorch, checks that each has exactly the trainable parameter
count of the Keras model (``EXPECTED_PARAMS``, read from ``hgsgc.models.build_model``), and times
one training step (forward, loss, backward, the optimizer's update, as the configs set it) at the
configs' per-rank batch:

- ``lstm_small``: Zaremba et al. 2014 small (embedding 200, 2 LSTM layers of 200, softmax over
  10,000 words), batch 20 x 20 tokens, plain SGD lr 1, gradient norm clipped at 5, state carried;
- ``alexnet_w025``: the AlexNet-style CIFAR-format model of the bench (``model.name=alexnet``,
  ``width: 0.25``, 32 x 32 x 3, conv 16-48-96-64-64, FC 1,024-1,024-10), batch 32, momentum 0.9,
  weight decay 5e-4, dropout 0.5;
- ``alexnet_small``: the Fashion-MNIST main job's model (conv 32, 64; FC 512, 256, 10), batch 32;
- ``resnet20``: He et al. 2016, CIFAR, batch 32; ``vgg16_w025``: the VGG-16-style net at width 0.25.

Each is timed in two modes: ``eager`` (one Python call per operation, as a framework without graph
capture runs it) and ``graph`` (the whole step captured once as a CUDA graph and replayed: the
launch-free lower bound). TF32 is allowed for matrix products and convolutions (TensorFlow's
default on Ampere and later GPUs) and cuDNN picks its fastest convolution algorithms
(``cudnn.benchmark``), as TensorFlow's autotuning does. Data are random tensors already on the GPU,
so input pipelines are not counted. Time per step = wall time of ``repeats`` x ``steps`` steps
between two ``torch.cuda.synchronize()`` calls; the median of the repeats is reported (ms).

It also times the compression compute of SGC on the GPU for each model's gradient size (numel):
exact top-k of ``|g|`` (``torch.topk``), the residual update (error feedback: ``r = g + r``,
then the selected entries zeroed) and 2-bit value packing (sign and one scale, four values per
byte), so the bench's assumption that compression speeds up on a GPU as much as the dense step can
be checked.

It times the two Hourglass stages apart for the two AlexNet-shaped models (``split``: CONV trunk
and FC head, split at the Flatten layer as hgsgc splits them). ``--sweep`` times only the
compression compute against the gradient's size (10 k to 64 M values), for a GPU-side compression
cost per size (its CPU counterpart: ``scripts/compression_cost_sweep.py``).

Output: one JSON file (``--out``) with the device, versions, per-model step times, the stage times
and the compression times; one line per measurement on stdout. Exit status 1 (a message) when
PyTorch sees no CUDA device; a model or size that fails is recorded with its error, the rest run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# trainable parameters of hgsgc.models.build_model(...) (Keras), read on 2026-12-04
EXPECTED_PARAMS = {"lstm_small": 4_651_600, "alexnet_w025": 1_280_730, "alexnet_small": 1_758_858,
                   "resnet20": 272_474, "vgg16_w025": 956_154}


class LSTMLM(nn.Module):
    """Zaremba small: int64 [B, T] -> logits [B, T, V]; state ((h1, h2), (c1, c2)) float32 [2, B, 200]."""

    def __init__(self, vocab=10_000, units=200):
        super().__init__()
        self.emb = nn.Embedding(vocab, units)
        self.lstm = nn.LSTM(units, units, num_layers=2, batch_first=True)
        self.out = nn.Linear(units, vocab)

    def forward(self, x, h, c):
        y, (h, c) = self.lstm(self.emb(x), (h, c))
        return self.out(y), h, c


def lstm_params_keras_equivalent(m: LSTMLM) -> int:
    """Keras' LSTM has one bias vector per layer (4u), PyTorch two (b_ih and b_hh): count one."""
    n = sum(p.numel() for p in m.parameters())
    return n - sum(getattr(m.lstm, f"bias_hh_l{i}").numel() for i in range(2))


def alexnet_w025():
    # TF "same" padding: for the stride-2 5x5 first conv, output 16 from 32 (padding 2 gives 16 too)
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(16, 48, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(48, 96, 3, padding=1), nn.ReLU(),
        nn.Conv2d(96, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2), nn.Flatten(),
        nn.Dropout(0.5), nn.Linear(64, 1024), nn.ReLU(),
        nn.Dropout(0.5), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10))


def alexnet_small():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(7 * 7 * 64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return F.relu(y + (x if self.short is None else self.short(x)))


def resnet20():
    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for stage, ch in enumerate((16, 32, 64)):
        for b in range(3):
            layers.append(Block(cin, ch, 2 if stage > 0 and b == 0 else 1))
            cin = ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


def vgg16_w025():
    cfg = (16, 16, "M", 32, 32, "M", 64, 64, 64, "M", 128, 128, 128, "M", 128, 128, 128, "M")
    layers, cin = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU()]
            cin = v
    layers += [nn.Flatten(), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.5),
               nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10)]
    return nn.Sequential(*layers)


def make_task(name, dev):
    """(model, step function taking no arguments, static tensors) for one workload."""
    g = torch.Generator(device=dev).manual_seed(0)
    if name == "lstm_small":
        m = LSTMLM().to(dev)
        n = lstm_params_keras_equivalent(m)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        x = torch.randint(0, 10_000, (20, 20), device=dev, generator=g)
        y = torch.randint(0, 10_000, (20, 20), device=dev, generator=g)
        h = torch.zeros(2, 20, 200, device=dev)
        c = torch.zeros(2, 20, 200, device=dev)

        def step():
            logits, h2, c2 = m(x, h, c)
            loss = F.cross_entropy(logits.reshape(-1, 10_000), y.reshape(-1))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0, foreach=True)
            opt.step()
            h.copy_(h2.detach())
            c.copy_(c2.detach())
        return m, n, step
    build = {"alexnet_w025": (alexnet_w025, (32, 3, 32, 32)), "alexnet_small": (alexnet_small, (32, 1, 28, 28)),
             "resnet20": (resnet20, (32, 3, 32, 32)), "vgg16_w025": (vgg16_w025, (32, 3, 32, 32))}[name]
    m = build[0]().to(dev)
    n = sum(p.numel() for p in m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9,
                          weight_decay=5e-4 if name in ("alexnet_w025", "vgg16_w025", "resnet20") else 0.0)
    x = torch.randn(build[1], device=dev, generator=g)
    y = torch.randint(0, 10, (build[1][0],), device=dev, generator=g)

    def step():
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    return m, n, step


def timed(fn, steps, repeats):
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / steps * 1e3)
    return out


def time_model(name, dev, steps, repeats, warmup):
    m, n, step = make_task(name, dev)
    rec = {"trainable_params": n, "expected_params": EXPECTED_PARAMS[name], "params_match": n == EXPECTED_PARAMS[name]}
    m.train()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream (also what graph capture requires)
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    eager = timed(step, steps, repeats)
    rec["eager_ms"] = eager
    rec["eager_ms_median"] = statistics.median(eager)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        gt = timed(graph.replay, steps, repeats)
        rec["graph_ms"] = gt
        rec["graph_ms_median"] = statistics.median(gt)
    except Exception as e:  # noqa: BLE001  (a capture failure is recorded, the eager figure stands)
        rec["graph_error"] = f"{type(e).__name__}: {e}"
    return rec


def time_split(name, dev, steps, repeats, warmup):
    """Hourglass stages on the GPU: CONV trunk (forward + backward from a given boundary gradient +
    update) and FC head (forward from a given boundary activation + loss + backward + update),
    timed apart in eager mode (ms per batch of 32), split at the Flatten layer as hgsgc splits."""
    m, _, _ = make_task(name, dev)
    cut = next(i for i, l in enumerate(m) if isinstance(l, nn.Flatten)) + 1
    trunk, head = m[:cut], m[cut:]
    shape = (32, 3, 32, 32) if name == "alexnet_w025" else (32, 1, 28, 28)
    x = torch.randn(shape, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)
    with torch.no_grad():
        a0 = trunk(x)
    ga = torch.randn_like(a0)
    ot = torch.optim.SGD(trunk.parameters(), lr=0.01, momentum=0.9)
    oh = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    a_in = a0.clone().requires_grad_(True)

    def conv_step():
        ot.zero_grad(set_to_none=False)
        trunk(x).backward(ga)
        ot.step()

    def fc_step():
        oh.zero_grad(set_to_none=False)
        a_in.grad = None
        F.cross_entropy(head(a_in), y).backward()
        oh.step()
    rec = {"boundary_floats_per_sample": int(a0[0].numel())}
    for fn, key in ((conv_step, "conv_ms"), (fc_step, "fc_ms")):
        for _ in range(warmup):
            fn()
        rec[key] = statistics.median(timed(fn, steps, repeats))
    return rec


def time_compression(numel, density, dev, steps, repeats):
    """SGC's per-step compression compute on the GPU for a flat gradient of ``numel`` float32."""
    g = torch.randn(numel, device=dev) * torch.rand(numel, device=dev)
    r = torch.zeros(numel, device=dev)
    k = max(1, int(round(numel * density)))
    rec = {"numel": numel, "density": density, "k": k}

    def topk():
        return torch.topk((g + r).abs(), k, sorted=False)

    def full():
        acc = g + r                                     # error feedback: add the residual
        _, idx = torch.topk(acc.abs(), k, sorted=False)  # exact top-k of |g + r|
        vals = acc[idx]
        scale = vals.abs().mean()                        # 2-bit: sign + one scale
        code = (vals > 0).to(torch.uint8)
        pad = (-k) % 4
        code = F.pad(code, (0, pad)).view(-1, 4)
        packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
        sent = torch.where(vals > 0, scale, -scale)
        r.copy_(acc)
        r[idx] -= sent                                  # residual keeps what was not sent
        return packed
    for fn, key in ((topk, "topk_ms"), (full, "sgc_compress_ms")):
        for _ in range(5):
            fn()
        t = timed(fn, steps, repeats)
        rec[key] = statistics.median(t)
    return rec


SWEEP_NUMEL = (10_000, 100_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000)


def sweep(a, dev):
    """SGC's compression compute on the GPU against the gradient's size (for a GPU performance model)."""
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "protocol": {"steps": a.steps, "repeats": a.repeats}, "sweep": []}
    for numel in SWEEP_NUMEL:
        for density in (0.01, 0.001):
            try:
                rec = time_compression(numel, density, dev, a.steps, a.repeats)
            except Exception as e:  # noqa: BLE001
                rec = {"numel": numel, "density": density, "error": f"{type(e).__name__}: {e}"}
            res["sweep"].append(rec)
            print("sweep", rec, flush=True)
            json.dump(res, open(a.out, "w"), indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--steps", type=int, default=200, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--models", nargs="+", default=list(EXPECTED_PARAMS))
    p.add_argument("--sweep", action="store_true",
                   help="only the compression compute against gradient size (numel 1e4 .. 6.4e7)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_step_reference: no CUDA device visible to PyTorch; run it on a GPU machine")
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    if a.sweep:
        return sweep(a, dev)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "protocol": {"steps": a.steps, "repeats": a.repeats, "warmup": a.warmup, "tf32": True,
                        "cudnn_benchmark": True}, "models": {}, "compression": []}
    for name in a.models:
        try:
            rec = time_model(name, dev, a.steps, a.repeats, a.warmup)
        except Exception as e:  # noqa: BLE001  (one model's failure is recorded; the others still run)
            rec = {"error": f"{type(e).__name__}: {e}"}
        res["models"][name] = rec
        print(name, {k: v for k, v in rec.items() if not isinstance(v, list)}, flush=True)
        json.dump(res, open(a.out, "w"), indent=1)
    res["split"] = {}
    for name in ("alexnet_w025", "alexnet_small"):
        try:
            rec = time_split(name, dev, a.steps, a.repeats, a.warmup)
        except Exception as e:  # noqa: BLE001
            rec = {"error": f"{type(e).__name__}: {e}"}
        res["split"][name] = rec
        print("split", name, rec, flush=True)
        json.dump(res, open(a.out, "w"), indent=1)
    for name in a.models:
        for density in (0.01, 0.001):
            try:
                rec = time_compression(EXPECTED_PARAMS[name], density, dev, a.steps, a.repeats)
            except Exception as e:  # noqa: BLE001
                rec = {"numel": EXPECTED_PARAMS[name], "density": density, "error": f"{type(e).__name__}: {e}"}
            rec["model"] = name
            res["compression"].append(rec)
            print("compression", rec, flush=True)
            json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
