"""One layer of every transformer stack: attention, (cross-attention,) then the MLP, each a residual
sub-layer with its norms placed by config (see common/nn/transformer.py for the keys)."""

import dataclasses
import math

import jax
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import (
  attention,
  conditioning,
  mlp,
  moe,  # noqa: F401  (registers mlp.kind "moe")
  noise,
  norms,
  quant,
)
from nnx_zoo.common.nn.linear import Linear, dtypes

NORM_PLACEMENTS = ("pre", "post", "both")


def check_modulation(cfg, *, cross_attention: bool = False) -> str:
  modulation = cfg.modulation
  if modulation not in conditioning.MODULATIONS:
    raise UserError(
      f"Unknown model.modulation {modulation!r}: use one of {conditioning.MODULATIONS}."
    )
  if modulation != "none" and (cfg.norm_placement != "pre" or cross_attention):
    raise UserError(
      f"model.modulation={modulation!r} modulates pre-norm blocks without cross-attention: set "
      "model.norm_placement='pre'."
    )
  return modulation


def check_placement(cfg):
  if cfg.norm_placement not in NORM_PLACEMENTS:
    raise UserError(
      f"Unknown model.norm_placement {cfg.norm_placement!r}: use one of {NORM_PLACEMENTS}."
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CrossCache:
  """A decoding state of a block with cross-attention: its self-attention KV cache and the
  source's keys and values, projected once for the whole decoding."""

  self_attn: attention.KVCache
  source: attention.SourceKV

  @property
  def index(self) -> jax.Array:  # as KVCache's: the tokens decoded so far
    return self.self_attn.index


class Block(nnx.Module):
  """One layer: attention, (cross-attention, if `cross_attention`: an encoder-decoder's decoder
  side,) then the MLP, each a residual sub-layer with norms placed by `norm_placement`
  (common/nn/transformer.py)."""

  def __init__(self, cfg, *, cross_attention: bool = False, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    D = cfg.dim
    # The projections into the residual stream start smaller in deep models (GPT-2's 1/sqrt(2L)).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.placement = cfg.norm_placement
    # Stochastic depth: each residual branch dropped per row in training (common/nn/noise.py).
    self.drop_path = cfg.drop_path
    both = self.placement == "both"
    self.attn_norm = norms.make(cfg.norm, D, **dt)
    self.attn = attention.Attention(
      cfg.attention, D, norm=cfg.norm, out_init_std=out_std, rngs=rngs, **dt
    )
    self.attn_out_norm = norms.make(cfg.norm, D, **dt) if both else None
    self.mlp_norm = norms.make(cfg.mlp_norm or cfg.norm, D, **dt)
    self.mlp = mlp.make(cfg.mlp, D, out_init_std=out_std, rngs=rngs, **dt)
    # adaLN-Zero: shift, scale and gate of the attention, then of the MLP.
    self.modulation = (
      conditioning.Modulation(D, 6, rngs=rngs, **dt)
      if check_modulation(cfg, cross_attention=cross_attention) == "adaln_zero"
      else None
    )
    self.mlp_out_norm = norms.make(cfg.norm, D, **dt) if both else None
    cross = cross_attention
    # Every source token is visible to every target token: no causal mask, no window.
    cross_cfg = ml_collections.ConfigDict({**cfg.attention.to_dict(), "mask": "bidirectional"})
    cross_cfg.window = 0
    self.cross_norm = norms.make(cfg.norm, D, **dt) if cross else None
    self.cross_attn = (
      attention.Attention(cross_cfg, D, norm=cfg.norm, out_init_std=out_std, rngs=rngs, **dt)
      if cross
      else None
    )
    self.cross_out_norm = norms.make(cfg.norm, D, **dt) if cross and both else None
    # model.quant: the sub-layers' projections multiply in int8 or fp8; the modulation's and
    # every other Linear of the model stay in the compute dtype (common/nn/quant.py).
    if (how := quant.settings(cfg)) is not None:
      for sub in [s for s in (self.attn, self.cross_attn, self.mlp) if s is not None]:
        for _, m in nnx.iter_graph(sub):
          if isinstance(m, Linear):
            m.quant = how

  def __call__(
    self,
    x_BTD,
    *,
    positions_BT,
    segment_ids_BT,
    position,
    cache=None,
    source_BSD=None,
    source_segment_ids_BS=None,
    cond_BD=None,
  ):
    """`source_BSD` (and its segment ids): what cross-attention attends to, an encoder's output;
    when decoding, `cache` is a `CrossCache` holding it projected instead. `cond_BD`: the
    conditioning a modulated block reads (`modulation`)."""
    if self.modulation is not None:
      return self._modulated(
        x_BTD,
        cond_BD,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        position=position,
        cache=cache,
      )
    post = self.placement == "post"
    crossed = isinstance(cache, CrossCache)
    h_BTD, self_cache = self.attn(
      x_BTD if post else self.attn_norm(x_BTD),
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=position,
      cache=cache.self_attn if crossed else cache,
    )
    x_BTD = self._residual(x_BTD, h_BTD, self.attn_norm, self.attn_out_norm)
    if self.cross_attn is not None:
      if crossed:
        source = cache.source
      elif source_BSD is None:
        raise UserError(
          "A block with cross-attention needs the source it attends to (an encoder's output)."
        )
      else:
        source = self.cross_attn.source_kv(source_BSD, source_segment_ids_BS)
      h_BTD = self.cross_attn.cross(
        x_BTD if post else self.cross_norm(x_BTD), source, segment_ids_BT=segment_ids_BT
      )
      x_BTD = self._residual(x_BTD, h_BTD, self.cross_norm, self.cross_out_norm)
      if cache is not None:
        self_cache = CrossCache(self_cache, source)
    # The padding mask (segment 0) keeps padding out of an MoE's load-balancing statistics.
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    h_BTD = self.mlp(x_BTD if post else self.mlp_norm(x_BTD), mask_BT=mask_BT)
    return self._residual(x_BTD, h_BTD, self.mlp_norm, self.mlp_out_norm), self_cache

  def _modulated(self, x_BTD, cond_BD, *, segment_ids_BT, cache, **attn_kw):
    """adaLN-Zero: x + gate * f(modulate(norm(x), shift, scale)), for attention then MLP."""
    if cond_BD is None:
      raise UserError("A block with model.modulation='adaln_zero' needs the conditioning cond_BD.")
    shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond_BD)
    h_BTD, new_cache = self.attn(
      conditioning.modulate(self.attn_norm(x_BTD), shift1, scale1),
      segment_ids_BT=segment_ids_BT,
      cache=cache,
      **attn_kw,
    )
    x_BTD = x_BTD + noise.drop_path(gate1[:, None, :] * h_BTD, self.drop_path)
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    h_BTD = self.mlp(conditioning.modulate(self.mlp_norm(x_BTD), shift2, scale2), mask_BT=mask_BT)
    return x_BTD + noise.drop_path(gate2[:, None, :] * h_BTD, self.drop_path), new_cache

  def _residual(self, x_BTD, h_BTD, norm, out_norm):
    """The sub-layer's output h added to the stream x (the branch dropped as a whole for the
    rows stochastic depth drops: after its own norm, before the stream's)."""
    if self.placement == "post":
      return norm(x_BTD + noise.drop_path(h_BTD, self.drop_path))
    h_BTD = h_BTD if out_norm is None else out_norm(h_BTD)
    return x_BTD + noise.drop_path(h_BTD, self.drop_path)
