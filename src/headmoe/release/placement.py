"""Where the release's text encoder and decoders run, and how their results travel.

- **Text encoder** (`node_text_encoder`): loaded on one rank per node, the node's first
  rank (local rank 0; nodes are runs of ``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun
  numbers them). For every prompt it encodes and broadcasts over the node's ranks: first an
  int64 header ``[status, L, C, tokens]`` (status 1 = the encoder failed there, so the other
  ranks fail at once instead of waiting), then the features ``[L, C]`` as float32 (exact for
  the bf16 the release computes in). No Python object is pickled. Every broadcast is bounded
  by the job's timeout (the process groups are created with it).
- **Image encoder** (`world_image_encoder`, image-to-video): the Wan2.2 VAE's encoder half,
  fp32, loaded on global rank 0 (`IMAGE_RANK`) only; it encodes the request's reference
  image once and broadcasts the latent ``[h, w, 48]`` to every rank of the world (the same
  header-then-tensor protocol, `broadcast_result`).
- **Decoders** (`output_video_decoder`, `output_audio_decoder`): loaded on the output ranks
  only (each DP group's writer: SP and CFG coordinates 0) and run there after the loop;
  the other ranks hold only the geometry (latent shapes and lengths).
- **Offload** (`Placed`): with ``offload`` the weights stay on the host and move to the
  rank's device only for a call; without it they are loaded on the device and stay there.
  On a CPU rank both are the same.

Dtypes: the text encoder in its folder's model dtype (`text_encoder.model_dtype`, bf16 for
the release); the video decoders in bf16 on CUDA and fp32 on the CPU; the audio decoder in
fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from headmoe.distributed.context import ParallelContext
from headmoe.distributed.launch import torchrun_env
from headmoe.distributed.topology import is_output_coords
from headmoe.pipeline.health import IMAGE_ENCODER_HINT, check_media
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.latents import latent_shape
from headmoe.pipeline.released import MAX_TEXT_TOKENS
from headmoe.release import audio_vae, text_encoder, turbo_vae, video_latents, wan_vae
from headmoe.release.folder import Release
from headmoe.release.text_encoder import Qwen35TextEncoder
from headmoe.release.turbo_vae import TurboVideoDecoder
from headmoe.release.wan_vae import WanImageEncoder, WanVideoDecoder

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

HOST = torch.device("cpu")
OK, FAILED = 0, 1


def is_output_rank(ctx: ParallelContext) -> bool:
    """`headmoe.distributed.topology.is_output_coords` of this rank."""
    return is_output_coords(ctx.coords)


#: torch threads of a component call on a CPU rank (see `Placed.use`)
CPU_THREADS = 1


class Placed:
    """A module's home between uses: its device, or the host when ``offload`` (and the
    device is not the CPU). ``with placed.use():`` has it on the device for the block.

    On a CPU device the block runs with `CPU_THREADS` torch threads: torch runs fp32 CPU
    convolutions on oneDNN, whose 1x1 and transposed convolutions give other last bits at
    other thread counts even in oneMKL's strict mode (`headmoe.numerics`; measured with torch
    2.13: a 1x1 conv1d over 128 channels and a stride-8 conv_transpose1d at 1, 2 and 3
    threads, the Oobleck decoder's audio by one int16 step), and a rank's thread count
    depends on the layout and the machine, so a fixed count keeps the bytes independent of
    both. Its cost: docs/benchmarks.md ("thread-count-independent numerics")."""

    def __init__(self, module: torch.nn.Module, device: torch.device, offload: bool):
        self.module, self.device = module, device
        self.offload = offload and device.type != "cpu"

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(CPU_THREADS)
        if self.offload:
            self.module.to(self.device)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            if self.offload:
                self.module.to(HOST)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()


def load_device(device: torch.device, offload: bool) -> torch.device:
    """Where a component is loaded: the host when offloading, else the rank's device."""
    return HOST if offload else device


# ---------------------------------------------------------------------- text
class NodeTextEncoder:
    """`TextEncoder` whose encoder runs on the node's first rank (``src``) and whose features
    every rank of the node receives by broadcast (see the module doc). ``encoder`` is a
    `Qwen35TextEncoder` on ``src`` and None elsewhere; ``group`` the node's process group
    (None: the default group), ``size`` the node's ranks (1: no broadcast). ``runs``: how
    many texts this rank's encoder has encoded (0 off ``src``; the sidecar's
    ``text_encoder_runs``)."""

    def __init__(self, encoder: Qwen35TextEncoder | None, out_channels: int, src: int,
                 group: ProcessGroup | None, size: int,
                 device: torch.device, offload: bool):
        self.encoder, self.out_channels = encoder, out_channels
        self.src, self.group, self.size, self.device = src, group, size, device
        self.max_tokens = encoder.max_tokens if encoder is not None else MAX_TEXT_TOKENS
        self.placed = Placed(encoder.model, device, offload) if encoder is not None else None
        self.runs = 0

    def encode(self, text: str) -> torch.Tensor:
        """``[L, out_channels]`` float32 on the CPU, the same on every rank of the node."""
        return self.encode_with_report(text)[0]

    def _run(self, text: str) -> tuple[list[int], torch.Tensor]:
        """On ``src``: ([L, C, tokens], features [L, C] float32)."""
        with self.placed.use():
            res = self.encoder.encode_batch([text])
        self.runs += 1
        kept, count = res.lengths[0], res.token_counts[0]
        feats = res.features[0, :kept].float()
        return [kept, feats.shape[1], count], feats

    def encode_with_report(self, text: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """Features as `encode` and ``{"tokens", "kept", "truncated"}`` (tokens before
        truncation at the encoder's ``max_tokens``)."""
        produce = (lambda: self._run(text)) if self.encoder is not None else None
        (kept, width, count), feats = broadcast_result(
            produce, self.src, self.group, self.size, self.device, 3,
            lambda h: (h[0], h[1]), torch.float32, "the text encoder")
        if width != self.out_channels:
            raise RuntimeError(f"text features from rank {self.src} are {width} wide, "
                               f"expected {self.out_channels}")
        return feats, {"tokens": count, "kept": kept, "truncated": count > kept}

    def figure_indices(self, text: str) -> list[int]:
        """Token indices of the ``<Figure 1>`` marker in ``text`` as the encoder tokenizes it
        (`Qwen35TextEncoder.figure_indices`), the same on every rank of the node."""
        def produce() -> tuple[list[int], torch.Tensor]:
            idx = self.encoder.figure_indices(text)
            return [len(idx)], torch.tensor(idx, dtype=torch.int64)

        _, idx = broadcast_result(produce if self.encoder is not None else None, self.src,
                                  self.group, self.size, self.device, 1, lambda h: (h[0],),
                                  torch.int64, "the text encoder's tokenizer")
        return idx.tolist()


def broadcast_result(
    produce: Callable[[], tuple[list[int], torch.Tensor]] | None, src: int,
    group: ProcessGroup | None,
    size: int, device: torch.device, header_len: int,
    shape: Callable[[list[int]], tuple[int, ...]], dtype: torch.dtype, what: str,
) -> tuple[list[int], torch.Tensor]:
    """``produce()`` (``header_len`` ints and a ``dtype`` tensor) computed on rank ``src``,
    where ``produce`` is given (None elsewhere), on every one of the ``size`` ranks of
    ``group``: first an int64 header ``[status, *ints]`` (status `FAILED` when ``produce``
    raised there, so the others fail at once instead of waiting), then the tensor, whose
    shape the receivers take from ``shape(ints)``. Returns the ints and the tensor (CPU)."""
    ints = payload = None
    if produce is not None:
        try:
            ints, payload = produce()
        except BaseException:
            if size > 1:  # release the waiting ranks before failing here
                failed = torch.tensor([FAILED] + [0] * header_len, dtype=torch.int64)
                dist.broadcast(failed.to(device), src=src, group=group)
            raise
    if size == 1:
        return ints, payload.cpu()
    h = (torch.tensor([OK, *ints], dtype=torch.int64) if ints is not None
         else torch.empty(header_len + 1, dtype=torch.int64)).to(device)
    dist.broadcast(h, src=src, group=group)
    status, *ints = (int(v) for v in h.tolist())
    if status != OK:
        raise RuntimeError(f"{what} failed on rank {src} (see its error)")
    buf = payload.to(device) if payload is not None else torch.empty(
        shape(ints), dtype=dtype, device=device)
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return ints, buf.cpu()


def node_of(ctx: ParallelContext, node_size: int | None = None) -> tuple[int, int]:
    """(first rank, size) of this rank's node. ``node_size`` defaults to torchrun's
    ``LOCAL_WORLD_SIZE`` (one node when not launched; in a data-parallel replica's own
    world, runs of its ranks that share a node: the gcd of the two sizes). Raises `ValueError` before any
    collective when the world does not split into equal nodes of consecutive ranks."""
    world = ctx.world_size
    env = torchrun_env()
    if node_size is None:
        node_size = env.local_world_size if env is not None else world
        if env is not None and env.world_size != world:  # one data-parallel replica's world
            node_size = math.gcd(node_size, world)  # (`headmoe.distributed.replicas`)
    if node_size < 1 or world % node_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={node_size} must divide the world of {world} ranks")
    if env is not None and env.world_size == world and env.local_rank != ctx.rank % node_size:
        raise ValueError(f"rank {ctx.rank} has LOCAL_RANK={env.local_rank}, expected "
                         f"{ctx.rank % node_size}: nodes must hold consecutive ranks")
    return ctx.rank // node_size * node_size, node_size


def node_group(ctx: ParallelContext, node_size: int, timeout: timedelta
               ) -> ProcessGroup | None:
    """This rank's node group (every rank creates every node's group, in order); None when
    the world is one node (the default group serves)."""
    world = ctx.world_size
    if node_size == world:
        return None
    nodes = [list(range(n, n + node_size)) for n in range(0, world, node_size)]
    group, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout)
    return group


def node_text_encoder(ctx: ParallelContext, release: Release, timeout: timedelta,
                      node_size: int | None = None) -> NodeTextEncoder:
    """The release's text encoder for this rank: loaded (`Qwen35TextEncoder.from_folder`,
    its model dtype, on the device or the host when offloading) on the node's first rank
    only; the node group created when the world spans several nodes."""
    src, size = node_of(ctx, node_size)
    group = node_group(ctx, size, timeout)
    encoder = None
    if ctx.rank == src:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # "falling back to the reference kernel" notes
        folder = release.text_encoder
        encoder = text_encoder.Qwen35TextEncoder.from_folder(
            folder, dtype=text_encoder.model_dtype(folder),
            device=load_device(ctx.device, release.offload))
    return NodeTextEncoder(encoder, release.model_config.text_in_channels, src, group, size,
                           ctx.device, release.offload)


# ---------------------------------------------------------------------- image
#: the rank that encodes an I2V reference image: global rank 0 (DP group 0's output rank)
IMAGE_RANK = 0


class WorldImageEncoder:
    """`headmoe.pipeline.interfaces.ImageEncoder` whose Wan2.2 encoder (fp32,
    `wan_vae.WanImageEncoder`) is loaded on `IMAGE_RANK` only and runs there once per request;
    every rank of the world receives the latent by broadcast (`broadcast_result`: header
    ``[status, h, w]``, then ``[h, w, 48]`` float32). Only `IMAGE_RANK` needs the image's
    pixels; the others check the latent size against the image's description."""

    def __init__(self, encoder: WanImageEncoder | None, size: int, device: torch.device,
                 offload: bool):
        self.encoder, self.size, self.device = encoder, size, device
        self.placed = Placed(encoder.vae, device, offload) if encoder is not None else None

    def encode(self, image: ReferenceImage) -> torch.Tensor:
        """``image`` (a `headmoe.pipeline.image.ReferenceImage`) -> its normalised latent
        ``[h, w, 48]`` float32 on the CPU, the same on every rank."""
        def produce() -> tuple[list[int], torch.Tensor]:
            with self.placed.use():
                z = self.encoder.encode(image.vae_input())  # [1, 48, 1, h, w]
            latent = z[0, :, 0].permute(1, 2, 0).contiguous()
            return list(latent.shape[:2]), latent

        (h, w), latent = broadcast_result(
            produce if self.encoder is not None else None, IMAGE_RANK, None, self.size,
            self.device, 2, lambda hw: (*hw, video_latents.LATENT_CHANNELS), torch.float32,
            "the image encoder")
        if (h, w) != tuple(image.latent_size):
            raise RuntimeError(f"the image latent from rank {IMAGE_RANK} is {h}x{w}, expected "
                               f"{image.latent_size[0]}x{image.latent_size[1]}")
        check_media("out of the image encoder", IMAGE_ENCODER_HINT, **{"image latent": latent})
        return latent


def world_image_encoder(ctx: ParallelContext, release: Release) -> WorldImageEncoder | None:
    """The release's image encoder (``release.image_encoder``; None when it has none),
    loaded on `IMAGE_RANK` only (on the device, or the host with ``offload``)."""
    if release.image_encoder is None:
        return None
    encoder = None
    if ctx.rank == IMAGE_RANK:
        encoder = wan_vae.WanImageEncoder(wan_vae.load_wan_encoder(
            release.image_encoder, dtype=torch.float32,
            device=load_device(ctx.device, release.offload)))
    return WorldImageEncoder(encoder, ctx.world_size, ctx.device, release.offload)


# ---------------------------------------------------------------------- decoders
def video_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (as the release runs its video decoders), fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class OutputVideoDecoder:
    """`VideoDecoder` with the release's geometry on every rank and the decoder (TurboV3 or
    Wan2.2, de-normalising inside) only where it was loaded (the output rank)."""

    latent_channels = video_latents.LATENT_CHANNELS

    def __init__(self, kind: str, decoder: TurboVideoDecoder | WanVideoDecoder | None = None,
                 placed: Placed | None = None):
        self.kind, self.decoder, self.placed = kind, decoder, placed

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        return latent_shape(num_frames, height, width)

    def decode(self, latents: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``[T, H, W, 48]`` fp32 -> ``[num_frames, 16 H, 16 W, 3]`` uint8."""
        if self.decoder is None:
            raise RuntimeError(f"the {self.kind} video decoder is loaded on output ranks only")
        with self.placed.use():
            return self.decoder.decode(latents, num_frames)


def output_video_decoder(ctx: ParallelContext, release: Release) -> OutputVideoDecoder:
    """The chosen video decoder (`Release.video_decoder`), loaded on the output rank only."""
    kind = release.video_decoder
    if not is_output_rank(ctx):
        return OutputVideoDecoder(kind)
    dtype, where = video_dtype(ctx.device), load_device(ctx.device, release.offload)
    if kind == "turbo":
        dec = turbo_vae.TurboVideoDecoder(
            turbo_vae.load_turbo_vae(release.video_decoder_path, dtype=dtype, device=where))
        module = dec.model
    else:
        dec = wan_vae.WanVideoDecoder(
            wan_vae.load_wan_vae(release.video_decoder_path, dtype=dtype, device=where))
        module = dec.vae
    return OutputVideoDecoder(kind, dec, Placed(module, ctx.device, release.offload))


class OutputAudioDecoder:
    """`AudioDecoder` with the Oobleck geometry (25 latents/s, 44.1 kHz after the 441/512
    resampling) on every rank and the decoder only on the output rank."""

    sample_rate = audio_vae.OUTPUT_SAMPLE_RATE
    tokens_per_second = audio_vae.LATENT_FPS

    def __init__(self, config: audio_vae.OobleckConfig,
                 decoder: audio_vae.OobleckAudioDecoder | None = None,
                 placed: Placed | None = None):
        self.config, self.decoder, self.placed = config, decoder, placed
        self.latent_channels, self.channels = config.latent_dim, config.out_channels

    def latent_length(self, duration_s: float) -> int:
        """`audio_vae.audio_latent_length`, as `OobleckAudioDecoder`."""
        return audio_vae.audio_latent_length(duration_s)

    def decode(self, latents: torch.Tensor, num_samples: int) -> torch.Tensor:
        """``[T, 64]`` fp32 -> ``[2, num_samples]`` fp32 in [-1, 1] at 44.1 kHz."""
        if self.decoder is None:
            raise RuntimeError("the audio decoder is loaded on output ranks only")
        with self.placed.use():
            return self.decoder.decode(latents, num_samples)


def output_audio_decoder(ctx: ParallelContext, release: Release) -> OutputAudioDecoder:
    """The Oobleck decoder (fp32) on the output rank; its configuration everywhere."""
    config, _ = audio_vae.folder_config(release.audio_decoder)
    if not is_output_rank(ctx):
        return OutputAudioDecoder(config)
    dec = audio_vae.load_oobleck_decoder(
        release.audio_decoder, dtype=torch.float32,
        device=load_device(ctx.device, release.offload))
    return OutputAudioDecoder(config, dec, Placed(dec.decoder, ctx.device, release.offload))
