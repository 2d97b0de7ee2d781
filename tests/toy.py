"""Small models in the four params flavours the planner accepts, for tests."""
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

VOCAB, WIDTH, HIDDEN, SEQ = 64, 64, 256, 8


def plain_params(key=0, layers=3):
    keys = jax.random.split(jax.random.key(key), 2 + 2 * layers)
    params = {"emb": jax.random.normal(keys[0], (VOCAB, WIDTH)) * 0.1,
              "head": jax.random.normal(keys[1], (WIDTH, VOCAB)) * 0.1}
    for i in range(layers):
        params[f"block{i}"] = {
            "w1": jax.random.normal(keys[2 + 2 * i], (WIDTH, HIDDEN)) * 0.1,
            "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(keys[3 + 2 * i], (HIDDEN, WIDTH)) * 0.1,
            "scale": jnp.ones((WIDTH,)),
            "gate": jnp.array(0.5),  # a 0-d parameter
        }
    return params


def plain_loss(params, tokens):
    h = params["emb"][tokens]
    for name in sorted(k for k in params if k.startswith("block")):
        b = params[name]
        h = h + b["gate"] * jax.nn.gelu((h * b["scale"]) @ b["w1"] + b["b1"]) @ b["w2"]
    logp = jax.nn.log_softmax(h @ params["head"])
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


class LinenMLP(nn.Module):
    boxed: bool = False

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.1)
        wrap = (lambda f, names: nn.with_partitioning(f, names)) if self.boxed else (lambda f, names: f)
        h = nn.Embed(VOCAB, WIDTH, embedding_init=wrap(init, ("vocab", "embed")))(tokens)
        for _ in range(2):
            h = h + nn.Dense(WIDTH, kernel_init=wrap(init, ("mlp", "embed")))(
                jax.nn.gelu(nn.Dense(HIDDEN, kernel_init=wrap(init, ("embed", "mlp")))(h)))
        return nn.Dense(VOCAB, kernel_init=wrap(init, ("embed", "vocab")))(h)


def linen_setup(boxed):
    model = LinenMLP(boxed=boxed)
    params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]

    def loss(p, tokens):
        logp = jax.nn.log_softmax(model.apply({"params": p}, tokens))
        targets = jnp.roll(tokens, -1, axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return params, loss


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.emb(tokens)
        h = h + self.down(jax.nn.gelu(self.up(h)))
        return self.head(h)


def nnx_setup():
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)

    def loss(s, tokens):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, s)(tokens))
        targets = jnp.roll(tokens, -1, axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return state, loss


def tokens(batch=32, key=1):
    return jax.random.randint(jax.random.key(key), (batch, SEQ), 0, VOCAB)


def lm_batch(vocab_size, batch=16, seq=16, key=3, abstract=False):
    """A language-model batch as the repository's models take it (inputs, targets, weights)."""
    if abstract:
        return {"inputs": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                "weights": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    tokens = jax.random.randint(jax.random.key(key), (batch, seq), 0, vocab_size)
    return {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "weights": jnp.ones((batch, seq))}


def own_step(grad_fn, optimizer, s):
    """A train step as users write it around ``grad_fn`` (``jax.value_and_grad`` or
    ``osdp_jax.value_and_grad``): their jit on the plan's shardings ``s`` (``osdp_jax.Shardings``),
    their optimizer, the params and optimizer state donated."""
    import optax

    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return jax.jit(step, in_shardings=(s.params, s.opt_state, s.batch), out_shardings=(s.params, s.opt_state, None),
                   donate_argnums=(0, 1))


def single_device_run(params, loss_fn, optimizer, batch, steps):
    """Losses and final params of plain single-device training, the reference for sharded runs."""
    import optax
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, o):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses, params


class _NnxBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class NnxViT(nnx.Module):
    """A small flax.nnx ViT written as a Python loop of blocks (no osdp-jax call in it)."""

    def __init__(self, rngs, d=32, depth=2, classes=10):
        self.patch = nnx.Linear(4 * 4 * 3, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (64, d)) * 0.02)
        self.blocks = nnx.List([_NnxBlock(d, rngs) for _ in range(depth)])
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, img):  # (b, 32, 32, 3) -> 64 patches of 4 x 4
        b = img.shape[0]
        x = img.reshape(b, 8, 4, 8, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 64, 48)
        x = self.patch(x) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def vit_setup(batch=32):
    graphdef, state = nnx.split(NnxViT(nnx.Rngs(0)), nnx.Param)

    def loss(s, b):
        logits = nnx.merge(graphdef, s)(b["img"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["label"][:, None], axis=-1))
    images = jax.random.normal(jax.random.key(2), (batch, 32, 32, 3))
    return state, loss, {"img": images, "label": jnp.arange(batch, dtype=jnp.int32) % 10}


def sharded_run(params, loss_fn, optimizer, plan, mesh, batch, steps, after_step=None):
    """Losses and final (sharded) params and optimizer state of ``steps`` steps under ``plan``;
    ``after_step(params, opt_state)`` is called after each."""
    import osdp_jax
    sharded = osdp_jax.shard(params, mesh, plan)
    opt_state = osdp_jax.init_opt_state(optimizer, sharded, plan, mesh)
    step = osdp_jax.make_train_step(loss_fn, optimizer, plan, mesh)
    losses = []
    for _ in range(steps):
        sharded, opt_state, loss = step(sharded, opt_state, batch)
        losses.append(float(loss))
        if after_step:
            after_step(sharded, opt_state)
    return losses, sharded, opt_state


def assert_matches_single_device(losses, sharded, params, loss_fn, optimizer, batch, rtol):
    """Losses equal plain single-device training's (``rtol``); parameters too. Adam divides by
    sqrt(v): for near-zero gradients, summation order alone moves an element by a small fraction
    of one step (lr = 1e-2), hence the absolute tolerance on parameters."""
    import numpy as np
    expected, final = single_device_run(params, loss_fn, optimizer, batch, len(losses))
    np.testing.assert_allclose(losses, expected, rtol=rtol)
    import osdp_jax
    for a, b in zip(jax.tree.leaves(osdp_jax.merge_segments(sharded)), jax.tree.leaves(final)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def stack_setup(n_layer=8, d_model=64, batch=64, seq=16, abstract=True):
    """A GPT-2-shaped model (repository code, ``osdp_jax.layers.Stack``) of ``n_layer`` layers:
    ``(module, params, loss_fn, batch)``."""
    from osdp_jax import models
    from osdp_jax.models import gpt2
    cfg = gpt2.gpt2_config(n_layer=n_layer, d_model=d_model, n_head=4, vocab_size=16, max_len=seq)
    module = gpt2.GPT2(cfg)
    params = models.abstract_params(module, seq) if abstract else models.init_params(module, seq, 0)
    return module, params, models.make_loss(module), lm_batch(cfg.vocab_size, batch, seq, abstract=abstract)


def in_a_process_with_collectives_in_order(request) -> bool:
    """Whether the calling test ran again, and passed, in a child pytest process whose XLA:CPU runs
    each step's collectives one at a time (``osdp_jax.core.simulated``): False where this process
    already does. Tests whose mixed plans let XLA:CPU's default scheduler run two collectives in
    one rendezvous (a hang and an abort) call it first; the suite's own processes keep the default
    scheduler, whose memory figures the other tests assert."""
    import os
    import subprocess
    import sys

    from osdp_jax.core.simulated import ORDERED_COLLECTIVES, collectives_ordered
    if collectives_ordered():
        return False
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {ORDERED_COLLECTIVES}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "-m", "slow or not slow", request.node.nodeid],
                          env=env, cwd=request.config.rootpath, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return True
