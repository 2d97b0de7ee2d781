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


def _regression_data(batch: int, width: int) -> dict:
    """Random ``x`` and ``y`` of ``(batch, width)``, the same for the same arguments."""
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.normal(size=(batch, width)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)}


def _linen_regression(model, data):
    """``(params, loss_fn, data)`` of a linen model fitted to ``data["y"]`` by mean squared error."""
    params = model.init(jax.random.key(0), data["x"])["params"]

    def loss_fn(p, b):
        return ((model.apply({"params": p}, b["x"]) - b["y"]) ** 2).mean()
    return params, loss_fn, data


def setup_mlp(layers=4, batch=16):
    """``(params, loss_fn, batch)`` of :class:`SetupNet`, a regression on random data."""
    return _linen_regression(SetupNet(layers), _regression_data(batch, 32))


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
    data = _regression_data(batch, d)

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


class ResidualMlp(nn.Module):
    """An unrolled stack of residual ``Dense`` blocks with LayerNorm (linen): parameter-heavy."""

    width: int = 256
    depth: int = 6

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = x + nn.Dense(self.width)(jax.nn.gelu(nn.LayerNorm()(x)))
        return x


def residual_mlp(depth=6, width=256, batch=64):
    """``(params, loss_fn, batch)`` of :class:`ResidualMlp`, a regression on random data."""
    return _linen_regression(ResidualMlp(width, depth), _regression_data(batch, width))


class UnevenMlp(nn.Module):
    """Unrolled residual MLP blocks of very different hidden widths (linen, bias-free kernels)."""

    widths: tuple = (2048, 128, 4096, 256, 1024, 64)
    d: int = 256

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            h = jax.nn.gelu(nn.Dense(width, use_bias=False)(nn.LayerNorm()(x)))
            x = x + nn.Dense(self.d, use_bias=False)(h)
        return x


def uneven_mlp(widths=(2048, 128, 4096, 256, 1024, 64), d=256, batch=16):
    """``(params, loss_fn, batch)`` of :class:`UnevenMlp`, a regression on random data."""
    return _linen_regression(UnevenMlp(tuple(widths), d), _regression_data(batch, d))


class NnxResidualBlock(nnx.Module):
    def __init__(self, width, rngs):
        self.norm, self.dense = nnx.LayerNorm(width, rngs=rngs), nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.dense(jax.nn.gelu(self.norm(x)))


class NnxResidualMlp(nnx.Module):
    """:class:`ResidualMlp` in nnx: a Python loop over an ``nnx.List`` of blocks."""

    def __init__(self, width, depth, rngs):
        self.blocks = nnx.List([NnxResidualBlock(width, rngs) for _ in range(depth)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def nnx_residual_mlp(depth=6, width=256, batch=64):
    """``(params, loss_fn, batch)`` of :class:`NnxResidualMlp`, units marked (``osdp_jax.units.mark``)."""
    graphdef, params = nnx.split(osdp_jax.units.mark(NnxResidualMlp(width, depth, nnx.Rngs(0))), nnx.Param)
    data = _regression_data(batch, width)

    def loss_fn(p, b):
        return ((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2).mean()
    return params, loss_fn, data


def equinox_transformer(depth=4, d=64, heads=4, seq=16, vocab=128, batch=16, mark=True):
    """``(params, loss_fn, batch)`` of an Equinox transformer written as Equinox code is: a Python
    list of blocks of ``eqx.nn.MultiheadAttention``, ``eqx.nn.MLP`` and ``eqx.nn.LayerNorm``, an
    ``eqx.nn.Embedding`` and an ``eqx.nn.Linear`` head, run per example under ``jax.vmap``; the
    arrays split from the static parts with ``eqx.partition`` (units marked unless ``mark`` is
    False)."""
    import equinox as eqx

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
            self.mlp = eqx.nn.MLP(d, d, 4 * d, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, depth + 2)
            self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:-1]]
            self.head = eqx.nn.Linear(d, vocab, key=keys[-1])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(x)

    model = Transformer(jax.random.key(0))
    if mark:
        osdp_jax.units.mark(model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)

    def loss_fn(p, b):
        logits = jax.vmap(eqx.combine(p, static))(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


class ScanBlock(nn.Module):
    """A pre-norm MLP block, ``(x, _) -> (x, None)`` as ``nn.scan`` runs it (Flax's own idiom)."""

    d: int

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
        return x + nn.Dense(self.d)(jax.nn.gelu(h)), None


class LinenScanned(nn.Module):
    """``depth`` :class:`ScanBlock`s stacked with Flax's own ``nn.scan`` (under ``nn.remat`` when
    ``remat``), or, with ``stack``, the same blocks run by ``osdp_jax.layers.Stack``."""

    d: int = 128
    depth: int = 6
    remat: bool = False
    stack: bool = False

    @nn.compact
    def __call__(self, x):
        if self.stack:
            x = osdp_jax.layers.Stack(_StackedBlock(self.d), self.depth, remat="none", name="blocks")(x)
        else:
            block = nn.remat(ScanBlock) if self.remat else ScanBlock
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.depth)(self.d, name="blocks")(x, None)
        return nn.Dense(1)(x)


class _StackedBlock(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        return ScanBlock(self.d, name="block")(x)[0]


def linen_scanned(d=128, depth=6, batch=32, remat=False, stack=False):
    """``(params, loss_fn, batch)`` of :class:`LinenScanned`, a regression on random data."""
    data = _regression_data(batch, d)
    return _linen_regression(LinenScanned(d, depth, remat, stack), {"x": data["x"], "y": data["y"][:, :1]})


class NnxScanBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class NnxScanned(nnx.Module):
    """``depth`` blocks made with ``nnx.vmap`` and run with ``nnx.scan`` (Flax's nnx idiom)."""

    def __init__(self, d, depth, rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxScanBlock(d, rngs)
        self.blocks = make(rngs)
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)
        return self.head(run(x, self.blocks))


def nnx_scanned(d=128, depth=6, batch=32):
    """``(params, loss_fn, batch)`` of :class:`NnxScanned`."""
    graphdef, params = nnx.split(NnxScanned(d, depth, nnx.Rngs(0)), nnx.Param)
    data = _regression_data(batch, d)
    data["y"] = data["y"][:, :1]

    def loss_fn(p, b):
        return ((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2).mean()
    return params, loss_fn, data


def lax_scanned(d=128, depth=6, batch=32, stack=False):
    """``(params, loss_fn, batch)`` of a plain-JAX MLP whose stacked blocks run in ``jax.lax.scan``
    (or, with ``stack``, in ``osdp_jax.layers.scan``)."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"blocks": {"w_in": 0.05 * jax.random.normal(keys[0], (depth, d, 4 * d)),
                         "w_out": 0.05 * jax.random.normal(keys[1], (depth, 4 * d, d))},
              "head": 0.05 * jax.random.normal(keys[2], (d, 1))}
    data = _regression_data(batch, d)
    data["y"] = data["y"][:, :1]

    def block(p, x):
        return x + jax.nn.gelu(x @ p["w_in"]) @ p["w_out"]

    def loss_fn(p, b):
        if stack:
            x = osdp_jax.layers.scan(block, p["blocks"], b["x"], remat="none")
        else:
            x = jax.lax.scan(lambda h, layer: (block(layer, h), None), b["x"], p["blocks"])[0]
        return ((x @ p["head"] - b["y"]) ** 2).mean()
    return params, loss_fn, data


class SwigluBlock(nn.Module):
    """A Llama-style decoder block: RMSNorm, bias-free ``DenseGeneral`` q/k/v/o with ``heads``
    query heads and ``kv_heads`` key/value heads (grouped-query attention when fewer; causal),
    rotary position embeddings on q and k when ``rope``, RMSNorm, SwiGLU ``gate``/``up``/``down``."""

    d: int = 128
    ffn: int = 352
    heads: int = 4
    kv_heads: int = 4
    rope: bool = False

    @nn.compact
    def __call__(self, x):
        k = self.d // self.heads
        h = nn.RMSNorm()(x)
        q = nn.DenseGeneral((self.heads, k), use_bias=False, name="q")(h)
        kk, v = (nn.DenseGeneral((self.kv_heads, k), use_bias=False, name=n)(h) for n in ("k", "v"))
        if self.rope:
            q, kk = _rotary(q), _rotary(kk)
        kk, v = (jnp.repeat(t, self.heads // self.kv_heads, axis=2) for t in (kk, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(k)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1), v)
        x = x + nn.DenseGeneral(self.d, axis=(-2, -1), use_bias=False, name="o")(a)
        h = nn.RMSNorm()(x)
        gate = nn.Dense(self.ffn, use_bias=False, name="gate")(h)
        up = nn.Dense(self.ffn, use_bias=False, name="up")(h)
        return x + nn.Dense(self.d, use_bias=False, name="down")(jax.nn.silu(gate) * up)


def _rotary(x, base: float = 10000.0):
    """Rotary position embedding of ``x`` ``[batch, seq, heads, dim]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwigluLM(nn.Module):
    """An embedding, ``layers`` :class:`SwigluBlock` run by ``osdp_jax.layers.Stack``, RMSNorm and
    an LM head."""

    vocab: int = 1024
    d: int = 128
    ffn: int = 352
    layers: int = 12
    heads: int = 4
    kv_heads: int = 4
    rope: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        block = SwigluBlock(self.d, self.ffn, self.heads, self.kv_heads, self.rope)
        x = osdp_jax.layers.Stack(block, self.layers, name="blocks")(x)
        return nn.Dense(self.vocab, use_bias=False, name="head")(nn.RMSNorm()(x))


def swiglu_lm(layers=12, d=128, ffn=352, vocab=1024, batch=32, seq=32, heads=4, kv_heads=4, rope=False):
    """``(params, loss_fn, batch)`` of :class:`SwigluLM` on random tokens."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    return _linen_classifier(SwigluLM(vocab, d, ffn, layers, heads, kv_heads, rope),
                             {"x": tokens[:, :-1], "y": tokens[:, 1:]})


def llama_lm(layers=8, d=128, ffn=344, vocab=1024, batch=32, seq=32):
    """A MoE-free Llama-style LM: :func:`swiglu_lm` with 8 query heads over 2 key/value heads
    (grouped-query attention) and rotary position embeddings."""
    return swiglu_lm(layers, d, ffn, vocab, batch, seq, heads=8, kv_heads=2, rope=True)


class VitStackBlock(nn.Module):
    """A pre-LayerNorm ViT encoder block (linen): multi-head self-attention with biases, GELU MLP."""

    d: int = 128
    heads: int = 4
    mlp: int = 512

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(self.heads, name="attn")(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(self.mlp, name="fc1")(nn.LayerNorm()(x)))
        return x + nn.Dense(self.d, name="fc2")(h)


class VitStack(nn.Module):
    """Patch embedding (a strided ``Conv``), a class token, position embeddings, ``layers``
    :class:`VitStackBlock` run by ``osdp_jax.layers.Stack``, LayerNorm and a classifier."""

    d: int = 128
    layers: int = 6
    patch: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(self.d, (self.patch, self.patch), strides=(self.patch, self.patch), name="patches")(images)
        x = x.reshape(x.shape[0], -1, self.d)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.d)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.d))
        x = osdp_jax.layers.Stack(VitStackBlock(self.d, mlp=4 * self.d), self.layers, name="blocks")(x)
        return nn.Dense(self.classes, name="head")(nn.LayerNorm()(x[:, 0]))


def vit_stack(layers=6, d=128, batch=32, size=16):
    """``(params, loss_fn, batch)`` of :class:`VitStack` on random ``size`` x ``size`` RGB images."""
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, 10, batch), jnp.int32)}
    return _linen_classifier(VitStack(d, layers), data)
