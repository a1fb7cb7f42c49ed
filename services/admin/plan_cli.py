"""`kvfabric plan`: the capacity and economics of a deployment, from its traffic, per-GPU
rates and prices (the model is `services.admin.plan`; the defaults are the reference deployment of
docs/design.md, 'The reference deployment'). Prints the inputs, then the outputs by group;
`--format json` prints the whole plan as one object instead (`csv`: one row per figure).

Options take display units (CNY, tokens); the model takes integer micro-CNY, converted here
once. A bad value is a usage error naming its option, raised before anything is computed.
"""

from __future__ import annotations

import math

import typer

from services.admin.output import check_format, emit, format_option
from services.admin.plan import Plan, PlanError, PlanInputs, plan
from services.admin.plan.inputs import MICRO  # micro-CNY per CNY

DEFAULTS = PlanInputs()

# The PlanInputs field each option sets, so a PlanError names the option the user typed.
OPTION_OF_FIELD = {
    "tokens_per_day": "--tokens-per-day",
    "input_tokens_per_request": "--input-tokens",
    "output_tokens_per_request": "--output-tokens",
    "hit_rate": "--hit-rate",
    "prefill_tokens_per_s_per_gpu": "--prefill-rate",
    "prefill_rate_hit_rate": "--prefill-rate-hit-rate",
    "decode_tokens_per_s_per_gpu": "--decode-rate",
    "hit_price_micro_cny_per_mtok": "--hit-price",
    "miss_price_micro_cny_per_mtok": "--miss-price",
    "output_price_micro_cny_per_mtok": "--output-price",
    "gpu_cost_micro_cny_per_hour": "--gpu-cost",
    "headroom_fraction": "--headroom",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "retention_days": "--retention-days",
    "ssd_reads_per_hit_token": "--ssd-reads-per-hit-token",
    "block_size_tokens": "--block-size",
    "index_bytes_per_block": "--index-bytes-per-block",
    "num_index_shards": "--index-shards",
    "gpus_per_prefill_server": "--gpus-per-prefill-server",
    "decode_super_node_gpus": "--super-node-gpus",
    "usd_per_cny": "--usd-per-cny",
}


def plan_command(
    tokens_per_day: float = typer.Option(
        DEFAULTS.tokens_per_day, help="tokens per day, input + output (e.g. 155e12)"
    ),
    input_tokens: float = typer.Option(
        DEFAULTS.input_tokens_per_request, help="average input tokens per request"
    ),
    output_tokens: float = typer.Option(
        DEFAULTS.output_tokens_per_request,
        help="average output tokens per request",
        show_default="718.67, 77K x 14K / 1.5M: prefill and decode GPUs balance 1:1",
    ),
    hit_rate: float = typer.Option(
        DEFAULTS.hit_rate, help="fraction of input tokens served from the KV store, in [0, 1)"
    ),
    prefill_rate: float = typer.Option(
        DEFAULTS.prefill_tokens_per_s_per_gpu,
        help="input tokens/s one prefill GPU serves at --prefill-rate-hit-rate",
    ),
    prefill_rate_hit_rate: float = typer.Option(
        DEFAULTS.prefill_rate_hit_rate,
        help="the hit rate --prefill-rate was measured at; the rate scales as its misses "
        "(compute-bound), so set it to --hit-rate to use --prefill-rate as is",
    ),
    decode_rate: float = typer.Option(
        DEFAULTS.decode_tokens_per_s_per_gpu, help="output tokens/s one decode GPU emits"
    ),
    hit_price: float = typer.Option(
        DEFAULTS.hit_price_micro_cny_per_mtok / MICRO, help="CNY per 1M cache-hit input tokens"
    ),
    miss_price: float = typer.Option(
        DEFAULTS.miss_price_micro_cny_per_mtok / MICRO, help="CNY per 1M cache-miss input tokens"
    ),
    output_price: float = typer.Option(
        DEFAULTS.output_price_micro_cny_per_mtok / MICRO, help="CNY per 1M output tokens"
    ),
    gpu_cost: float = typer.Option(
        DEFAULTS.gpu_cost_micro_cny_per_hour / MICRO,
        help="CNY per GPU-hour (an assumption: ~USD 2, an H800's rental price)",
    ),
    headroom: float = typer.Option(
        DEFAULTS.headroom_fraction, help="extra GPUs over the load, a fraction (0.25: +25%)"
    ),
    kv_bytes_per_token: int = typer.Option(
        DEFAULTS.kv_bytes_per_token, help="bytes of KV (full-attention layers) per token"
    ),
    retention_days: float = typer.Option(
        DEFAULTS.retention_days, help="days a block stays on the SSD tier"
    ),
    ssd_reads_per_hit_token: int = typer.Option(
        DEFAULTS.ssd_reads_per_hit_token,
        help="SSD reads of each hit token's KV (2: decode loads the prefix too)",
    ),
    block_size: int = typer.Option(DEFAULTS.block_size_tokens, help="tokens per KV block"),
    index_bytes_per_block: float = typer.Option(
        DEFAULTS.index_bytes_per_block,
        help="kv-index RAM per indexed block (the default: measured at 10M blocks)",
    ),
    index_shards: int = typer.Option(
        DEFAULTS.num_index_shards, help="kv-index shards the blocks are split over by hash"
    ),
    gpus_per_prefill_server: int = typer.Option(
        DEFAULTS.gpus_per_prefill_server, help="GPUs per prefill server"
    ),
    super_node_gpus: list[int] = typer.Option(
        list(DEFAULTS.decode_super_node_gpus),
        help="GPUs per decode super-node; repeat for each size to plan",
    ),
    usd_per_cny: float = typer.Option(DEFAULTS.usd_per_cny, help="USD per CNY"),
    fmt: str = format_option(),
) -> None:
    """What a day's traffic needs in GPUs, servers, SSD and control plane, and what it earns
    per GPU-hour. The defaults are the reference deployment (docs/design.md, 'The reference
    deployment')."""
    try:
        inputs = PlanInputs(
            tokens_per_day=_whole(tokens_per_day, "--tokens-per-day"),
            input_tokens_per_request=input_tokens,
            output_tokens_per_request=output_tokens,
            hit_rate=hit_rate,
            prefill_tokens_per_s_per_gpu=prefill_rate,
            prefill_rate_hit_rate=prefill_rate_hit_rate,
            decode_tokens_per_s_per_gpu=decode_rate,
            hit_price_micro_cny_per_mtok=_whole(hit_price * MICRO, "--hit-price"),
            miss_price_micro_cny_per_mtok=_whole(miss_price * MICRO, "--miss-price"),
            output_price_micro_cny_per_mtok=_whole(output_price * MICRO, "--output-price"),
            gpu_cost_micro_cny_per_hour=_whole(gpu_cost * MICRO, "--gpu-cost"),
            headroom_fraction=headroom,
            kv_bytes_per_token=kv_bytes_per_token,
            retention_days=retention_days,
            ssd_reads_per_hit_token=ssd_reads_per_hit_token,
            block_size_tokens=block_size,
            index_bytes_per_block=index_bytes_per_block,
            num_index_shards=index_shards,
            gpus_per_prefill_server=gpus_per_prefill_server,
            decode_super_node_gpus=tuple(super_node_gpus),
            usd_per_cny=usd_per_cny,
        )
    except PlanError as exc:
        raise typer.BadParameter(exc.message, param_hint=OPTION_OF_FIELD[exc.field]) from exc
    check_format(fmt)
    result = plan(inputs)
    # CSV: one row per figure (group, name, value), the JSON's groups flattened.
    rows = [
        {"group": group, "name": name, "value": value}
        for group, figures in result.to_dict().items()
        for name, value in (figures.items() if isinstance(figures, dict) else [("", figures)])
    ]
    emit(fmt, rows, lambda: typer.echo(render_plan(result)), document=result.to_dict())


def _whole(value: float, option: str) -> int:
    if not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}", param_hint=option)
    return round(value)


def render_plan(result: Plan) -> str:
    """The readable table: the inputs, then the outputs grouped, labels aligned."""
    groups = _groups(result)
    width = max(len(label) for rows in groups.values() for label, _ in rows)
    lines: list[str] = []
    for title, rows in groups.items():
        lines.append(title)
        lines.extend(f"  {label:<{width}}  {value}" for label, value in rows)
        lines.append("")
    return "\n".join(lines).rstrip()


def _groups(result: Plan) -> dict[str, list[tuple[str, str]]]:
    i, t, f, m = result.inputs, result.traffic, result.fleet, result.money
    s, c = result.storage, result.control_plane
    prices = (
        i.hit_price_micro_cny_per_mtok,
        i.miss_price_micro_cny_per_mtok,
        i.output_price_micro_cny_per_mtok,
    )
    day_tokens = (t.hit_tokens_per_day, t.miss_tokens_per_day, t.output_tokens_per_day)
    shares = (m.hit_revenue_share, m.miss_revenue_share, m.output_revenue_share)
    ratio = f.prefill_to_decode_ratio
    margin = m.gross_margin
    super_nodes = [
        (f"decode super-nodes of {size}", f"{n:,}") for size, n in f.num_decode_super_nodes.items()
    ]
    return {
        "inputs": [
            ("tokens/day (input + output)", _si(i.tokens_per_day)),
            ("input tokens/request", _num(i.input_tokens_per_request)),
            ("output tokens/request", _num(i.output_tokens_per_request, 2)),
            ("cache-hit rate of input", _pct(i.hit_rate)),
            (
                "prefill input tokens/s per GPU",
                f"{_si(i.prefill_tokens_per_s_per_gpu)} at {_pct(i.prefill_rate_hit_rate)} hit",
            ),
            ("decode output tokens/s per GPU", _si(i.decode_tokens_per_s_per_gpu)),
            (
                "CNY per 1M tokens: hit / miss / output",
                " / ".join(f"{p / MICRO:g}" for p in prices),
            ),
            ("GPU cost per hour (assumed)", _cny(i.gpu_cost_micro_cny_per_hour)),
            ("headroom", _pct(i.headroom_fraction)),
            ("KV bytes/token", _num(i.kv_bytes_per_token)),
            ("retention", f"{i.retention_days:g} days"),
            ("SSD reads per hit token", str(i.ssd_reads_per_hit_token)),
            ("block size", f"{i.block_size_tokens} tokens"),
            ("kv-index bytes per block", f"{i.index_bytes_per_block:g}"),
            ("kv-index shards", f"{i.num_index_shards:,}"),
            ("GPUs per prefill server", str(i.gpus_per_prefill_server)),
            ("decode super-node sizes", ", ".join(map(str, i.decode_super_node_gpus))),
            ("USD per CNY", f"{i.usd_per_cny:g}"),
        ],
        "traffic": [
            ("requests/s", _num(t.requests_per_s)),
            ("input tokens/s", _si(t.input_tokens_per_s)),
            ("output tokens/s", _si(t.output_tokens_per_s)),
            (
                "hit / miss input tokens/s",
                f"{_si(t.hit_tokens_per_s)} / {_si(t.miss_tokens_per_s)}",
            ),
            ("hit / miss / output tokens/day", " / ".join(_si(n) for n in day_tokens)),
        ],
        "GPUs and servers": [
            (
                "prefill input tokens/s per GPU",
                f"{_si(f.prefill_tokens_per_s_per_gpu)} at this hit rate",
            ),
            ("prefill GPUs", f"{f.num_prefill_gpus:,} (load {f.prefill_gpus_busy:,.1f})"),
            ("decode GPUs", f"{f.num_decode_gpus:,} (load {f.decode_gpus_busy:,.1f})"),
            ("prefill+decode pairs", f"{f.num_pairs:,}"),
            ("GPUs in all", f"{f.num_gpus:,}"),
            ("P:D ratio", "n/a" if ratio is None else f"{ratio:.2f}"),
            ("prefill servers", f"{f.num_prefill_servers:,} of {i.gpus_per_prefill_server} GPUs"),
            *super_nodes,
        ],
        "money": [
            ("revenue/day: hit", _cny(m.hit_revenue_micro_cny_per_day, 0)),
            ("revenue/day: miss", _cny(m.miss_revenue_micro_cny_per_day, 0)),
            ("revenue/day: output", _cny(m.output_revenue_micro_cny_per_day, 0)),
            ("revenue/day", _cny(m.revenue_micro_cny_per_day, 0)),
            ("revenue mix: hit / miss / output", " / ".join(_pct(x) for x in shares)),
            (
                "revenue per busy GPU-hour",
                _cny_usd(
                    m.revenue_per_busy_gpu_hour_micro_cny, m.revenue_per_busy_gpu_hour_micro_usd
                ),
            ),
            (
                "revenue per deployed GPU-hour",
                _cny_usd(m.revenue_per_gpu_hour_micro_cny, m.revenue_per_gpu_hour_micro_usd),
            ),
            ("GPU cost/day", _cny(m.gpu_cost_micro_cny_per_day, 0)),
            ("gross profit/day", _cny(m.gross_profit_micro_cny_per_day, 0)),
            ("gross margin", "n/a" if margin is None else _pct(margin)),
        ],
        "storage": [
            ("new KV tokens/day (miss + output)", _si(s.new_kv_tokens_per_day)),
            ("SSD capacity for the retention", _bytes(s.ssd_capacity_bytes)),
            ("SSD read bandwidth", _bytes(s.ssd_read_bytes_per_s) + "/s"),
            ("SSD read per prefill GPU", _bytes(s.ssd_read_bytes_per_s_per_prefill_gpu) + "/s"),
            ("SSD write bandwidth", _bytes(s.ssd_write_bytes_per_s) + "/s"),
        ],
        "control plane": [
            ("requests/s", _num(c.requests_per_s)),
            ("blocks stored/s", _num(c.blocks_stored_per_s)),
            ("blocks removed/s (steady state)", _num(c.blocks_removed_per_s)),
            ("KV events/s (block entries)", _num(c.kv_events_per_s)),
            (
                "kv-index blocks: a day / retained",
                f"{_si(c.index_blocks_per_day)} / {_si(c.index_blocks)}",
            ),
            ("kv-index RAM per day of retention", _bytes(c.index_bytes_per_day_of_retention)),
            ("kv-index RAM for the retention", _bytes(c.index_bytes) + " (one replica)"),
            (
                "kv-index RAM per shard",
                f"{_bytes(c.index_bytes_per_shard)} "
                f"({_si(c.index_blocks_per_shard)} blocks; each replica)",
            ),
            ("kv-index shards at least", f"{c.index_min_shards:,} (32-bit rows per shard)"),
        ],
    }


def _num(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _si(value: float) -> str:
    """Token counts and rates as people quote them: 155T, 1.78B, 14K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}{unit}"
    return _num(value, 2)


def _pct(share: float) -> str:
    return f"{share * 100:.1f}%"


def _cny(micro_cny: int, digits: int = 2) -> str:
    return f"CNY {micro_cny / MICRO:,.{digits}f}"


def _cny_usd(micro_cny: int, micro_usd: int) -> str:
    return f"{_cny(micro_cny)} (USD {micro_usd / MICRO:,.2f})"


def _bytes(num_bytes: float) -> str:
    for unit, power in (("PiB", 5), ("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if num_bytes >= 1024**power:
            return f"{num_bytes / 1024**power:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"
