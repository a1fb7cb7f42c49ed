# From a workload to a cluster. Four groups compute exactly what `kvfabric plan` computes
# (services/admin/plan/model.py: _traffic, _fleet, _storage, _control_plane), with its
# formulas, its defaults and its rounding, and come out under the same names; the last group
# turns them into nodes: storage, NATS, kv-index and control-plane nodes, and which pool runs
# each service. `tests/deploy/test_terraform.py` checks the first four against the CLI.
#
# Rounding, as the Python does it:
# - `round(x)` rounds half to even. Terraform has no round(): floor(x + 0.5), less one on an
#   exact tie that lands on an odd integer.
# - `_ceil(gpus)` is ceil(gpus x (1 - 1e-12)): an exact 1,185-GPU load computed as
#   1185.0000000000002 buys no 1,186th GPU.
# - `-(-a // b)` on integers is ceil(a / b).
# Terraform's numbers are arbitrary-precision where Python's are float64, so a last digit may
# differ; no count does for the reference deployment (the pytest compares them).

locals {
  seconds_per_day = 86400 # model.py, SECONDS_PER_DAY
  # A kv-index tier table numbers its rows in 32 bits (model.py, MAX_INDEX_ROWS_PER_SHARD).
  max_index_rows_per_shard = pow(2, 32) - 3

  # inputs.py, REFERENCE_OUTPUT_TOKENS_PER_REQUEST: from the reference figures' constants
  # (77K input, 14K decode, 1.5M prefill), not from this module's other inputs.
  output_tokens_per_request = (
    var.output_tokens_per_request != null ? var.output_tokens_per_request : 77000 * 14000 / 1500000
  )
}

# --- traffic: model.py, _traffic --------------------------------------------------------

locals {
  tokens_per_request = var.input_tokens_per_request + local.output_tokens_per_request
  requests_per_day   = var.tokens_per_day / local.tokens_per_request
  input_share        = var.input_tokens_per_request / local.tokens_per_request

  # input_per_day = round(tokens_per_day x input_share)
  input_x              = var.tokens_per_day * local.input_share
  input_round          = floor(local.input_x + 0.5)
  input_tokens_per_day = local.input_round - (local.input_round - local.input_x == 0.5 && local.input_round % 2 == 1 ? 1 : 0)

  # hit_per_day = round(input_per_day x hit_rate)
  hit_x              = local.input_tokens_per_day * var.hit_rate
  hit_round          = floor(local.hit_x + 0.5)
  hit_tokens_per_day = local.hit_round - (local.hit_round - local.hit_x == 0.5 && local.hit_round % 2 == 1 ? 1 : 0)

  output_tokens_per_day = var.tokens_per_day - local.input_tokens_per_day
  miss_tokens_per_day   = local.input_tokens_per_day - local.hit_tokens_per_day

  traffic = {
    requests_per_day      = local.requests_per_day
    requests_per_s        = local.requests_per_day / local.seconds_per_day
    input_tokens_per_day  = local.input_tokens_per_day
    output_tokens_per_day = local.output_tokens_per_day
    hit_tokens_per_day    = local.hit_tokens_per_day
    miss_tokens_per_day   = local.miss_tokens_per_day
    input_tokens_per_s    = local.input_tokens_per_day / local.seconds_per_day
    output_tokens_per_s   = local.output_tokens_per_day / local.seconds_per_day
    hit_tokens_per_s      = local.hit_tokens_per_day / local.seconds_per_day
    miss_tokens_per_s     = local.miss_tokens_per_day / local.seconds_per_day
  }
}

# --- fleet: model.py, _fleet; the prefill rate is inputs.py's effective_prefill_... --------

locals {
  # A prefill GPU is compute-bound on its misses: the miss rate is what it always computes.
  prefill_miss_tokens_per_s_per_gpu = var.prefill_tokens_per_s_per_gpu * (1 - var.prefill_rate_hit_rate)
  prefill_tokens_per_s_per_gpu      = local.prefill_miss_tokens_per_s_per_gpu / (1 - var.hit_rate)

  prefill_gpus_busy = local.traffic.input_tokens_per_s / local.prefill_tokens_per_s_per_gpu
  decode_gpus_busy  = local.traffic.output_tokens_per_s / var.decode_tokens_per_s_per_gpu
  headroom_scale    = 1 + var.headroom_fraction
  # model.py, _ceil: 1e-12, written out (checkov's HCL parser reads no negative exponent).
  float_noise      = 0.000000000001
  num_prefill_gpus = ceil(local.prefill_gpus_busy * local.headroom_scale * (1 - local.float_noise))
  num_decode_gpus  = ceil(local.decode_gpus_busy * local.headroom_scale * (1 - local.float_noise))

  fleet = {
    prefill_tokens_per_s_per_gpu = local.prefill_tokens_per_s_per_gpu
    prefill_gpus_busy            = local.prefill_gpus_busy
    decode_gpus_busy             = local.decode_gpus_busy
    num_prefill_gpus             = local.num_prefill_gpus
    num_decode_gpus              = local.num_decode_gpus
    num_pairs                    = max(local.num_prefill_gpus, local.num_decode_gpus)
    num_gpus                     = local.num_prefill_gpus + local.num_decode_gpus
    prefill_to_decode_ratio      = local.num_decode_gpus > 0 ? local.num_prefill_gpus / local.num_decode_gpus : null
    num_prefill_servers          = ceil(local.num_prefill_gpus / var.gpus_per_prefill_server)
    # Keyed by the size as a string, as `kvfabric plan --json` writes its dict's keys.
    num_decode_super_nodes = {
      for size in distinct(var.decode_super_node_gpus) : tostring(size) => ceil(local.num_decode_gpus / size)
    }
  }
}

# --- storage: model.py, _storage ----------------------------------------------------------

locals {
  new_kv_tokens_per_day = local.miss_tokens_per_day + local.output_tokens_per_day
  # Hit tokens' KV read by prefill, once per hit token.
  prefill_read_bytes_per_s = local.traffic.hit_tokens_per_s * var.kv_bytes_per_token

  # The values that model.py passes through round(), rounded half to even as there.
  storage_unrounded = {
    retained_tokens                      = local.new_kv_tokens_per_day * var.retention_days
    ssd_write_bytes_per_s                = local.new_kv_tokens_per_day * var.kv_bytes_per_token / local.seconds_per_day
    ssd_read_bytes_per_s                 = local.prefill_read_bytes_per_s * var.ssd_reads_per_hit_token
    ssd_read_bytes_per_s_per_prefill_gpu = local.prefill_read_bytes_per_s / local.prefill_gpus_busy
  }
  storage_rounded = {
    for name, x in local.storage_unrounded :
    name => floor(x + 0.5) - (floor(x + 0.5) - x == 0.5 && floor(x + 0.5) % 2 == 1 ? 1 : 0)
  }

  storage = {
    new_kv_tokens_per_day                = local.new_kv_tokens_per_day
    ssd_capacity_bytes                   = local.storage_rounded.retained_tokens * var.kv_bytes_per_token
    ssd_write_bytes_per_s                = local.storage_rounded.ssd_write_bytes_per_s
    ssd_read_bytes_per_s                 = local.storage_rounded.ssd_read_bytes_per_s
    ssd_read_bytes_per_s_per_prefill_gpu = local.storage_rounded.ssd_read_bytes_per_s_per_prefill_gpu
  }
}

# --- control plane: model.py, _control_plane ----------------------------------------------

locals {
  blocks_stored_per_s  = (local.traffic.miss_tokens_per_s + local.traffic.output_tokens_per_s) / var.block_size_tokens
  index_blocks_per_day = local.new_kv_tokens_per_day / var.block_size_tokens
  index_blocks         = local.index_blocks_per_day * var.retention_days
  index_bytes          = ceil(local.index_blocks * var.index_bytes_per_block) # math.ceil

  control_plane = {
    requests_per_s                   = local.traffic.requests_per_s
    blocks_stored_per_s              = local.blocks_stored_per_s
    blocks_removed_per_s             = local.blocks_stored_per_s # steady state: all stored is evicted in time
    kv_events_per_s                  = 2 * local.blocks_stored_per_s
    index_blocks_per_day             = local.index_blocks_per_day
    index_blocks                     = local.index_blocks
    index_bytes_per_day_of_retention = ceil(local.index_blocks_per_day * var.index_bytes_per_block)
    index_bytes                      = local.index_bytes
    index_blocks_per_shard           = local.index_blocks / var.num_index_shards
    index_bytes_per_shard            = ceil(local.index_bytes / var.num_index_shards)
    index_min_shards                 = max(1, ceil(local.index_blocks / local.max_index_rows_per_shard))
  }
}

# --- the deployment: nodes per pool, beyond what `kvfabric plan` says ----------------------

locals {
  # Decode: whole super-nodes of the size built; a super-node is bought whole.
  decode_super_node_size        = var.decode_super_node_size != null ? var.decode_super_node_size : var.decode_super_node_gpus[0]
  num_decode_super_nodes        = ceil(local.num_decode_gpus / local.decode_super_node_size)
  decode_servers_per_super_node = local.decode_super_node_size / var.gpus_per_decode_server

  # Storage: enough raw SSD that the retention (plan's ssd_capacity_bytes, times the copies)
  # fits under the eviction watermark, and enough nodes to serve the plan's read bandwidth.
  storage_raw_bytes_needed   = local.storage.ssd_capacity_bytes * var.storage_replication_factor / var.storage_fill_fraction
  storage_nodes_for_capacity = ceil(local.storage_raw_bytes_needed / var.storage_node_bytes)
  storage_nodes_for_reads    = ceil(local.storage.ssd_read_bytes_per_s / var.storage_node_read_bytes_per_s)
  num_storage_nodes          = max(var.storage_min_nodes, local.storage_nodes_for_capacity, local.storage_nodes_for_reads)

  # kv-index: every replica of every shard holds its shard in full (plan's bytes per shard);
  # as many shard replicas on a node as fit in its share of RAM.
  kv_index_shard_replicas          = var.num_index_shards * var.kv_index_replicas
  kv_index_shard_replicas_per_node = floor(var.kv_index_node_memory_bytes * var.kv_index_memory_fraction / local.control_plane.index_bytes_per_shard)
  num_kv_index_nodes               = ceil(local.kv_index_shard_replicas / max(1, local.kv_index_shard_replicas_per_node))

  # NATS, the messages its servers deliver each second (docs/design.md, 'Two planes'):
  # - the token streams: one TokenChunk per stream_tokens_per_message output tokens;
  # - per request, its control messages and a kv-index match asked of every shard and
  #   answered by one replica (shared/kv_index_client.py): 2 per shard;
  # - the KV event log, which every replica of every shard reads in full.
  nats_messages_per_s = (
    local.traffic.output_tokens_per_s / var.stream_tokens_per_message
    + local.traffic.requests_per_s * (var.nats_messages_per_request + 2 * var.num_index_shards)
    + local.traffic.requests_per_s * var.kv_event_batches_per_request * local.kv_index_shard_replicas
  )
  nats_nodes_at_least = max(var.nats_min_nodes, ceil(local.nats_messages_per_s / var.nats_messages_per_s_per_node))
  # An odd count: JetStream's meta group decides by majority.
  num_nats_nodes = local.nats_nodes_at_least + (local.nats_nodes_at_least % 2 == 0 ? 1 : 0)

  # Control plane: stateless ingress and router replicas sized on requests/s, and billing.
  ingress_replicas  = ceil(local.traffic.requests_per_s / var.ingress_requests_per_s_per_replica)
  router_replicas   = ceil(local.traffic.requests_per_s / var.router_requests_per_s_per_replica)
  control_replicas  = local.ingress_replicas + local.router_replicas + var.billing_replicas
  num_control_nodes = max(var.control_min_nodes, ceil(local.control_replicas * var.control_vcpus_per_replica / var.control_node_vcpus))

  # Every pool has the same attributes, so callers can take the map as one type.
  node_pools = {
    prefill = {
      nodes                = local.fleet.num_prefill_servers
      gpus_per_node        = var.gpus_per_prefill_server
      super_nodes          = 0
      nodes_per_super_node = 0
      services             = ["prefill", "swa-memcache"]
    }
    decode = {
      nodes                = local.num_decode_super_nodes * local.decode_servers_per_super_node
      gpus_per_node        = var.gpus_per_decode_server
      super_nodes          = local.num_decode_super_nodes
      nodes_per_super_node = local.decode_servers_per_super_node
      services             = ["decode", "swa-memcache"]
    }
    storage = {
      nodes                = local.num_storage_nodes
      gpus_per_node        = 0
      super_nodes          = 0
      nodes_per_super_node = 0
      services             = ["dfs-storage"] # the shared store's file system (3FS or another POSIX one)
    }
    kv_index = {
      nodes                = local.num_kv_index_nodes
      gpus_per_node        = 0
      super_nodes          = 0
      nodes_per_super_node = 0
      services             = ["kv-index"]
    }
    nats = {
      nodes                = local.num_nats_nodes
      gpus_per_node        = 0
      super_nodes          = 0
      nodes_per_super_node = 0
      services             = ["nats"]
    }
    control = {
      nodes                = local.num_control_nodes
      gpus_per_node        = 0
      super_nodes          = 0
      nodes_per_super_node = 0
      services             = ["ingress", "router", "billing"]
    }
  }

  # Which pool runs each service, and how many of it (docs/design.md, 'Services').
  placement = {
    # One worker per device: every deployed GPU runs one, the rounding's spares included.
    prefill = { pools = ["prefill"], replicas = local.node_pools.prefill.nodes * var.gpus_per_prefill_server }
    decode  = { pools = ["decode"], replicas = local.node_pools.decode.nodes * var.gpus_per_decode_server }
    # One per GPU node: prefill and decode each put windows into their own node's memcache
    # (docs/design.md, 'Sliding-window state').
    swa-memcache = { pools = ["prefill", "decode"], replicas = local.node_pools.prefill.nodes + local.node_pools.decode.nodes }
    kv-index     = { pools = ["kv_index"], replicas = local.kv_index_shard_replicas }
    ingress      = { pools = ["control"], replicas = local.ingress_replicas }
    router       = { pools = ["control"], replicas = local.router_replicas }
    billing      = { pools = ["control"], replicas = var.billing_replicas }
    nats         = { pools = ["nats"], replicas = local.num_nats_nodes }
  }
}
