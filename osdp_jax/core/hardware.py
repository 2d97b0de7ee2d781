"""Hardware descriptions: the constants the time model needs, each with its source.

Collective times use the ring model over N devices with per-device bus bandwidth W (bytes/s) and a
per-collective latency a (s), for a message of V bytes (the full, unsharded size):

    all-gather(V)     = a + (N-1)/N * V / W
    reduce-scatter(V) = a + (N-1)/N * V / W
    all-reduce(V)     = a + 2(N-1)/N * V / W

On a mesh with several data-parallel axes (e.g. ``("replica", "data")`` = nodes x devices per
node), ``links`` may give each axis its own W and a; a collective over several axes runs at the
slowest of their bandwidths and the largest of their latencies (a flat ring crosses every link).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import jax


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type and its interconnect.

    Attributes:
      name: preset name or a free label.
      memory_bytes: device memory, bytes.
      flops: dense matmul throughput assumed reachable by a training step, FLOP/s per device.
      bandwidth: per-device collective (bus) bandwidth, bytes/s.
      latency: fixed cost of one collective, seconds.
      sources: where each number comes from, keyed by field name.
      links: per mesh axis, ``{"bandwidth": bytes/s, "latency": s}``, for axes whose link differs
        from the default (e.g. the inter-node axis of a 2-D mesh).
      overlap: the share of a step's compute that collectives can run behind, between 0 and 1:
        a step's exposed collective time is ``max(0, C - overlap * F)`` for C seconds of
        collectives and F of compute. 0 where XLA runs them apart (XLA:CPU); ``osdp-jax profile``
        measures it (:func:`osdp_jax.core.profile.measure_overlap`).
    """

    name: str
    memory_bytes: int
    flops: float
    bandwidth: float
    latency: float
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    links: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    overlap: float = 0.0

    def __post_init__(self):
        for field in ("memory_bytes", "flops", "bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware.{field} must be positive, got {getattr(self, field)!r}")
        if self.latency < 0:
            raise ValueError(f"Hardware.latency must be >= 0, got {self.latency!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Hardware.overlap must be between 0 and 1 (the share of compute that collectives "
                             f"run behind), got {self.overlap!r}")
        for axis, link in self.links.items():
            if set(link) != {"bandwidth", "latency"} or not link["bandwidth"] > 0 or link["latency"] < 0:
                raise ValueError(f"Hardware.links[{axis!r}] must be {{'bandwidth': > 0, 'latency': >= 0}}, "
                                 f"got {dict(link)!r}")

    def link(self, axes=None) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency s)`` of a collective over mesh ``axes`` (None: default)."""
        if not axes:
            return self.bandwidth, self.latency
        links = [self.links.get(a, {"bandwidth": self.bandwidth, "latency": self.latency}) for a in axes]
        return min(x["bandwidth"] for x in links), max(x["latency"] for x in links)

    def all_gather(self, nbytes: float, n: int, axes=None) -> float:
        """Seconds to all-gather a V-byte array over n devices: a + (n-1)/n * V / W."""
        w, a = self.link(axes)
        return 0.0 if n <= 1 else a + (n - 1) / n * nbytes / w

    reduce_scatter = all_gather  # same volume and latency in the ring model

    def all_reduce(self, nbytes: float, n: int, axes=None) -> float:
        """Seconds to all-reduce a V-byte array over n devices: a + 2(n-1)/n * V / W."""
        w, a = self.link(axes)
        return 0.0 if n <= 1 else a + 2 * (n - 1) / n * nbytes / w

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"sources": dict(self.sources),
                                           "links": {k: dict(v) for k, v in self.links.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Hardware":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown hardware field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


_GiB = 2**30
PRESETS: dict[str, Hardware] = {
    "titan-rtx-pcie3": Hardware(
        "titan-rtx-pcie3", 24 * _GiB, 16.3e12, 15.75e9, 20e-6, {
            "memory_bytes": "NVIDIA TITAN RTX spec sheet: 24 GB GDDR6",
            "flops": "NVIDIA TITAN RTX spec sheet: 16.3 TFLOPS FP32 (the OSDP paper trained in FP32)",
            "bandwidth": "PCI-SIG PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s per direction",
            "latency": "assumed 20 us per collective over PCIe (typical NCCL small-message latency)",
            "overlap": "0 until measured: osdp-jax profile on the GPUs",
        }),
    "a100-40gb": Hardware(
        "a100-40gb", 40 * _GiB, 312e12, 300e9, 10e-6, {
            "memory_bytes": "NVIDIA A100 datasheet: 40 GB HBM2",
            "flops": "NVIDIA A100 datasheet: 312 TFLOPS BF16 dense tensor core",
            "bandwidth": "NVIDIA A100 datasheet: NVLink 3 600 GB/s total = 300 GB/s per direction",
            "latency": "assumed 10 us per collective over NVLink",
            "overlap": "0 until measured: osdp-jax profile on the GPUs",
        }),
    "h100-80gb": Hardware(
        "h100-80gb", 80 * _GiB, 989e12, 450e9, 10e-6, {
            "memory_bytes": "NVIDIA H100 SXM5 datasheet: 80 GB HBM3",
            "flops": "NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense tensor core",
            "bandwidth": "NVIDIA H100 SXM5 datasheet: NVLink 4 900 GB/s total = 450 GB/s per direction",
            "latency": "assumed 10 us per collective over NVLink",
            "overlap": "0 until measured: osdp-jax profile on the GPUs",
        }),
    "h200": Hardware(
        "h200", 141 * 10**9, 989e12, 450e9, 10e-6, {
            "memory_bytes": "NVIDIA H200 SXM datasheet: 141 GB HBM3e",
            "flops": "NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense tensor core",
            "bandwidth": "NVIDIA H200 SXM datasheet: NVLink 900 GB/s total = 450 GB/s per direction",
            "latency": "assumed 10 us per collective over NVLink",
            "overlap": "0 until measured: osdp-jax profile on the GPUs",
        }),
}
# The paper's TITAN RTX nodes, two of them joined by 10 Gb Ethernet: for meshes with axes
# ("replica", "data") = (nodes, GPUs per node), as in OSDP's group-sharding experiment.
PRESETS["titan-rtx-pcie3-2nodes-10gbe"] = dataclasses.replace(
    PRESETS["titan-rtx-pcie3"], name="titan-rtx-pcie3-2nodes-10gbe",
    links={"replica": {"bandwidth": 1.25e9, "latency": 50e-6}},
    sources={**PRESETS["titan-rtx-pcie3"].sources,
             "links.replica.bandwidth": "IEEE 802.3ae 10 Gb Ethernet: 10 Gbit/s = 1.25 GB/s per direction",
             "links.replica.latency": "assumed 50 us per collective across nodes over TCP"})


CPU_PROFILE_ENV = "OSDP_JAX_CPU_PROFILE"  # "nominal" or a profile file: a CPU mesh's default, fixed


def _cpu_preset(n_local: int) -> Hardware:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        ram = 16 * _GiB
    return Hardware("cpu", max(1, ram // max(1, n_local)), 20e9, 4e9, 50e-6, {
        "memory_bytes": "host RAM (sysconf) divided by the number of simulated devices",
        "flops": "nominal 20 GFLOP/s per simulated device, not measured",
        "bandwidth": "nominal 4 GB/s host memcpy for in-process CPU collectives, not measured",
        "latency": "nominal 50 us per in-process CPU collective, not measured",
        "overlap": "0: XLA:CPU runs collectives apart from compute",
    })


def default_hardware(mesh, measure: bool = True) -> Hardware:
    """The hardware profile a plan on ``mesh`` uses when none is given.

    Args:
      mesh: a ``jax.sharding.Mesh``; its first device's platform and kind pick the preset (H200,
        H100, A100, TITAN RTX; an unknown GPU gets the H100's numbers under its own name). A CPU
        mesh of several devices in one process gets its own collectives and FLOP/s, measured by
        ``osdp-jax profile``'s machinery the first time and read back after
        (:func:`osdp_jax.core.profile.cached_cpu_profile`); over several processes, whose plans
        must agree, the nominal CPU constants (``osdp-jax profile`` measures such a mesh).
        ``$OSDP_JAX_CPU_PROFILE`` fixes a CPU mesh's profile instead: ``nominal`` (the nominal
        constants) or the path of an ``osdp-jax profile`` file, for runs that must plan alike
        whatever the machine's load (the test suite sets ``nominal``).
      measure: False: a CPU mesh's nominal constants instead, never measured.

    Returns:
      A :class:`Hardware`, its memory read from ``device.memory_stats()`` where the device
      reports it.
    """
    device = mesh.devices.flat[0]
    kind = (getattr(device, "device_kind", "") or "").lower()
    if device.platform == "cpu":
        fixed = os.environ.get(CPU_PROFILE_ENV, "")
        if fixed and fixed != "nominal":
            try:
                return load(fixed)
            except (OSError, ValueError) as e:
                raise ValueError(f"${CPU_PROFILE_ENV}={fixed!r} is neither 'nominal' nor a readable profile file "
                                 f"written by 'osdp-jax profile' ({e}); unset it to use the measured default") from None
        if measure and not fixed and mesh.devices.size > 1 and jax.process_count() == 1:
            from osdp_jax.core.profile import cached_cpu_profile  # it measures with this module's presets
            return cached_cpu_profile(mesh)
        return _cpu_preset(len(jax.local_devices()))
    for key, name in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-40gb"),
                      ("titan rtx", "titan-rtx-pcie3")):
        if key in kind:
            hw = PRESETS[name]
            break
    else:
        hw = dataclasses.replace(PRESETS["h100-80gb"], name=f"unknown ({kind}), h100 numbers")
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        hw = dataclasses.replace(hw, memory_bytes=int(stats["bytes_limit"]),
                                 sources={**hw.sources, "memory_bytes": "device.memory_stats()"})
    return hw


def save(hw: Hardware, path, measurements: dict | None = None) -> None:
    """Write a hardware profile as JSON, for :func:`load` or ``plan(hardware=path)``.

    Args:
      hw: the profile.
      path: the file written.
      measurements: the raw measurements behind it (``profile``'s second value), kept beside it.
    """
    with open(path, "w") as f:
        json.dump({"hardware": hw.to_dict(), "measurements": measurements or {}}, f, indent=1)


def load(path) -> Hardware:
    """Read a hardware profile written by :func:`save` (or ``osdp-jax profile``).

    Args:
      path: the JSON file.

    Raises:
      ValueError: the file is not an osdp-jax hardware profile.
    """
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d, dict) or "hardware" not in d:
        raise ValueError(f"{path} is not an osdp-jax hardware profile (no 'hardware' key)")
    return Hardware.from_dict(d["hardware"])


def resolve_hardware(hardware, mesh) -> Hardware:
    """The :class:`Hardware` that ``plan(hardware=...)`` means.

    Args:
      hardware: a ``Hardware``; a preset name (a key of ``PRESETS``); the path of a profile
        ``.json`` written by ``osdp-jax profile``; a dict of ``Hardware`` fields; or None, the
        mesh's default (:func:`default_hardware`).
      mesh: the mesh the plan is for.

    Raises:
      ValueError: an unknown preset name, or a file that is not a profile.
      TypeError: any other type.
    """
    if hardware is None:
        return default_hardware(mesh)
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Mapping):
        return Hardware.from_dict(hardware)
    if isinstance(hardware, str):
        if hardware in PRESETS:
            return PRESETS[hardware]
        if hardware.endswith(".json") and os.path.isfile(hardware):
            return load(hardware)
        raise ValueError(f"unknown hardware preset {hardware!r}; known: {sorted(PRESETS)}, or a "
                         f"profile .json file written by 'osdp-jax profile'")
    raise TypeError(f"hardware must be a Hardware, a preset name or a dict, got {type(hardware).__name__}")
