"""What attention.impl="auto" resolves to in each layer of a model config: the line `zoo show`
prints. The rules are the table's (common/attention_impl.py); this module only reads them for
every layer kind of a stack, which is why it stands apart from the table: it needs the stack's
layer configs (`stack.layer_config`), and the stack imports the layer that imports the
table.
"""

from nnx_zoo.common import attention_impl
from nnx_zoo.common.nn import stack


def describe_auto(
  model_cfg, *, platform: str, seq_len: int, segments: bool = True, device_kind: str = ""
) -> str:
  """What "auto" resolves to for a model config's layers on `platform` at `seq_len` (training,
  no cache): one "impl (why)" per distinct choice, for `zoo show`. Only layers whose
  attention.impl is "auto" are described ("" if none)."""
  if "attention" not in model_cfg or "num_layers" not in model_cfg:
    return ""
  seen = {}
  for i in range(model_cfg.num_layers):
    layer = stack.layer_config(model_cfg, i)
    att = layer.attention
    if att.impl != "auto":
      continue
    impl, why = attention_impl.resolve_auto(
      platform=platform,
      dtype=model_cfg.dtype,
      head_dim=att.head_dim,
      seq_len=seq_len,
      bias=layer.position.kind in ("alibi", "relative"),
      segments=segments,
      softcap=bool(att.softcap),
      bidirectional_window=bool(att.window) and att.mask != "causal",
      device_kind=device_kind,
    )
    seen.setdefault(impl, why)
  return "; ".join(f"{impl} ({why})" for impl, why in seen.items())
