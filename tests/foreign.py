"""Models written the way users write them, not through the repository's GPT-2/OPT/BERT code and
with no osdp-jax call inside: an einsum transformer with a tied embedding, grouped-query
attention, a gated MLP and an unrolled loop of blocks (linen); a ResNet with GroupNorm (linen
convolutions); a ViT-style encoder run as a Python loop of blocks (nnx, marked with
``osdp_jax.units.mark``); and a plain-JAX MLP of ``@osdp_jax.units.unit`` blocks. Each maker
returns ``(params, loss_fn, batch)``. Used by ``tests/test_unit_calls.py`` and, at the sizes of
:data:`FAMILIES`, by ``experiments/benchmarks/foreign_models.py``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import osdp_jax


class Attention(nn.Module):
    d: int
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        k = self.d // self.heads
        wq = self.param("wq", nn.initializers.normal(0.02), (self.d, self.heads, k))
        wkv = self.param("wkv", nn.initializers.normal(0.02), (self.d, 2, k))  # one shared k/v head (GQA)
        wo = self.param("wo", nn.initializers.normal(0.02), (self.heads, k, self.d))
        q = jnp.einsum("btd,dhk->bthk", x, wq)
        kv = jnp.einsum("btd,dck->btck", x, wkv)
        s = jnp.einsum("bthk,bsk->bhts", q, kv[:, :, 0]) / np.sqrt(k)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        return jnp.einsum("bthk,hkd->btd", jnp.einsum("bhts,bsk->bthk", a, kv[:, :, 1]), wo)


class GatedMlp(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w_in", nn.initializers.normal(0.02), (self.d, 2, 2 * self.d))
        w_out = self.param("w_out", nn.initializers.normal(0.02), (2 * self.d, self.d))
        h = jnp.einsum("btd,dgf->btgf", x, w)
        return (jax.nn.silu(h[:, :, 0]) * h[:, :, 1]) @ w_out


class Block(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.d)(nn.RMSNorm()(x))
        return x + GatedMlp(self.d)(nn.RMSNorm()(x))


class EinsumLM(nn.Module):
    """Tied embedding (looked up, then ``x @ table.T``), einsum layers, an unrolled loop."""

    vocab: int = 256
    d: int = 64
    layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        table = self.param("embedding", nn.initializers.normal(1.0), (self.vocab, self.d))
        x = table[tokens]
        for i in range(self.layers):
            x = Block(self.d, name=f"block_{i}")(x)
        return nn.RMSNorm()(x) @ table.T


def einsum_lm(layers=4, d=64, vocab=256, batch=16, seq=32):
    """``(params, loss_fn, batch)`` of :class:`EinsumLM`."""
    model = EinsumLM(vocab, d, layers)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    return _linen_classifier(model, {"x": tokens[:, :-1], "y": tokens[:, 1:]})


def _linen_classifier(model, data):
    """``(params, loss_fn, data)`` of a linen model whose outputs are logits for ``data["y"]``."""
    params = model.init(jax.random.key(0), data["x"])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    return params, loss_fn, data


class ResBlock(nn.Module):
    features: int
    stride: int = 1
    norm: str = "group"  # "batch": BatchNorm, whose statistics are a mutable collection

    @nn.compact
    def __call__(self, x, train: bool = True):
        def norm():
            if self.norm == "batch":
                return nn.BatchNorm(use_running_average=not train, momentum=0.9)
            return nn.GroupNorm(num_groups=8)
        y = nn.Conv(self.features, (3, 3), (self.stride, self.stride), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if x.shape[-1] != self.features or self.stride != 1:
            x = nn.Conv(self.features, (1, 1), (self.stride, self.stride), use_bias=False, name="proj")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stages of residual blocks (auto-named ``ResBlock_0`` ...), global pooling, a classifier."""

    stages: tuple = (2, 2, 2)
    width: int = 32
    classes: int = 10
    norm: str = "group"

    @nn.compact
    def __call__(self, images, train: bool = True):
        x = nn.relu(nn.Conv(self.width, (3, 3), use_bias=False)(images))
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = ResBlock(self.width * 2 ** i, 2 if i and not j else 1, self.norm)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def resnet(stages=(2, 2, 2), width=32, batch=16, size=16):
    """``(params, loss_fn, batch)`` of :class:`ResNet` on ``size`` x ``size`` RGB images."""
    model = ResNet(tuple(stages), width)
    rng = np.random.default_rng(0)
    return _linen_classifier(model, {"x": jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32),
                                     "y": jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)})


def resnet_bn(stages=(2, 2), width=16, batch=16, size=8):
    """``(params, batch_stats, loss_fn, batch)``: :class:`ResNet` with BatchNorm, trained with its
    statistics as state: ``loss_fn(p, b, state) -> (loss, new state)`` (``make_train_step(...,
    state=True)``), ``state`` being ``{"batch_stats": ...}``."""
    model = ResNet(tuple(stages), width, norm="batch")
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)}
    variables = model.init(jax.random.key(0), data["x"], train=False)

    def loss_fn(p, b, state):
        logits, new = model.apply({"params": p, **state}, b["x"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), new
    return variables["params"], {"batch_stats": variables["batch_stats"]}, loss_fn, data


class SetupBlock(nn.Module):
    """A block whose layers are made in ``setup`` (not ``@nn.compact``)."""

    def setup(self):
        self.fc1, self.fc2 = nn.Dense(64), nn.Dense(32)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class SetupNet(nn.Module):
    layers: int = 4

    def setup(self):
        self.blocks = [SetupBlock() for _ in range(self.layers)]  # named blocks_0, blocks_1, ...

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def setup_mlp(layers=4, batch=16):
    """``(params, loss_fn, batch)`` of :class:`SetupNet`, a regression on random data."""
    net = SetupNet(layers)
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, 32)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch, 32)), jnp.float32)}
    params = net.init(jax.random.key(0), data["x"])["params"]

    def loss_fn(p, b):
        return ((net.apply({"params": p}, b["x"]) - b["y"]) ** 2).mean()
    return params, loss_fn, data


class VitBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x))))


class Vit(nnx.Module):
    """Patch embedding, a Python loop of blocks, mean pooling, a classifier."""

    def __init__(self, depth=4, d=64, patch=4, classes=10, *, rngs):
        self.patch = patch
        self.embed = nnx.Linear(patch * patch * 3, d, rngs=rngs)
        self.blocks = nnx.List([VitBlock(d, rngs) for _ in range(depth)])
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=1))


def vit(depth=4, d=64, batch=16, mark=True):
    """``(params, loss_fn, batch)`` of :class:`Vit`, its units marked (``osdp_jax.units.mark``)."""
    model = Vit(depth, d, rngs=nnx.Rngs(0))
    if mark:
        osdp_jax.units.mark(model)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, 16, 16, 3)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)}

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    return params, loss_fn, data


class BnBlock(nnx.Module):
    """A residual block with BatchNorm (``nnx.BatchStat`` state) and dropout (rng state)."""

    def __init__(self, d, rngs, dropout):
        self.fc, self.bn = nnx.Linear(d, d, rngs=rngs), nnx.BatchNorm(d, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.relu(self.bn(self.fc(x))))


class BnMlp(nnx.Module):
    def __init__(self, depth, d, rngs, dropout):
        self.blocks = nnx.List([BnBlock(d, rngs, dropout) for _ in range(depth)])
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def nnx_bn_mlp(depth=4, d=64, batch=32, dropout=0.2):
    """``(params, state, loss_fn, batch)`` of :class:`BnMlp` (nnx, units marked), trained with its
    batch statistics and rng state as state: ``loss_fn(p, b, state) -> (loss, new state)``
    (``make_train_step(..., state=True)``), ``state`` as ``nnx.as_pure`` gives it."""
    model = osdp_jax.units.mark(BnMlp(depth, d, nnx.Rngs(0, dropout=1), dropout))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, d)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch, 1)), jnp.float32)}

    def loss_fn(p, b, state):
        m = nnx.merge(graphdef, p, nnx.as_pure(state))  # new variables at this trace level
        loss = ((m(b["x"]) - b["y"]) ** 2).mean()
        return loss, nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param)))
    return params, nnx.as_pure(state), loss_fn, data


@osdp_jax.units.unit
def mlp_block(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def plain_mlp(layers=4, d=64, batch=16):
    """``(params, loss_fn, batch)`` of a plain-JAX MLP whose blocks are ``@osdp_jax.units.unit``."""
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    params = {f"layer{i}": {"w1": 0.1 * jax.random.normal(keys[2 * i], (d, 2 * d)),
                            "w2": 0.1 * jax.random.normal(keys[2 * i + 1], (2 * d, d))} for i in range(layers)}
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, d)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch, d)), jnp.float32)}

    def loss_fn(p, b):
        x = b["x"]
        for i in range(layers):
            x = mlp_block(p[f"layer{i}"], x)
        return ((x - b["y"]) ** 2).mean()
    return params, loss_fn, data


# the three families at the foreign-model benchmarks' size (8 simulated devices, global batch 32)
FAMILIES = {
    "einsum LM, tied embedding, 8 unrolled blocks (linen)": lambda: einsum_lm(layers=8, d=128, batch=32),
    "ResNet 3x2 blocks, GroupNorm (linen conv)": lambda: resnet((2, 2, 2), width=32, batch=32),
    "ViT, 8 blocks in a Python loop (nnx)": lambda: vit(depth=8, d=128, batch=32),
}


def ddp_fsdp_peaks(params, loss_fn, batch, opt, mesh) -> tuple[int, int]:
    """XLA's per-device peak bytes of the train step under DDP and under FSDP without units: the
    ends the foreign-model benchmarks place their budgets between."""
    return tuple(osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, layout).peak_bytes
                 for layout in (osdp_jax.Layout.ddp(params, mesh), osdp_jax.Layout.fsdp(params, mesh)))
