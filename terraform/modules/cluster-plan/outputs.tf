# The first five outputs are `kvfabric plan --json`'s groups of the same names (money left
# out), key for key; the rest are the deployment built on them.

output "inputs" {
  description = "The inputs the plan used, defaults resolved (PlanInputs' fields)."
  value = {
    tokens_per_day               = var.tokens_per_day
    input_tokens_per_request     = var.input_tokens_per_request
    output_tokens_per_request    = local.output_tokens_per_request
    hit_rate                     = var.hit_rate
    prefill_tokens_per_s_per_gpu = var.prefill_tokens_per_s_per_gpu
    prefill_rate_hit_rate        = var.prefill_rate_hit_rate
    decode_tokens_per_s_per_gpu  = var.decode_tokens_per_s_per_gpu
    headroom_fraction            = var.headroom_fraction
    kv_bytes_per_token           = var.kv_bytes_per_token
    retention_days               = var.retention_days
    ssd_reads_per_hit_token      = var.ssd_reads_per_hit_token
    block_size_tokens            = var.block_size_tokens
    index_bytes_per_block        = var.index_bytes_per_block
    num_index_shards             = var.num_index_shards
    gpus_per_prefill_server      = var.gpus_per_prefill_server
    decode_super_node_gpus       = var.decode_super_node_gpus
  }
}

output "traffic" {
  description = "Requests and tokens per day and per second (kvfabric plan's 'traffic')."
  value       = local.traffic
}

output "fleet" {
  description = "GPU loads, GPUs, prefill servers and decode super-nodes of every planned size (kvfabric plan's 'fleet')."
  value       = local.fleet
}

output "storage" {
  description = "The SSD tier: capacity for the retention, read and write bandwidth, bytes (kvfabric plan's 'storage')."
  value       = local.storage
}

output "control_plane" {
  description = "Requests, KV events and kv-index memory (kvfabric plan's 'control_plane')."
  value       = local.control_plane
}

output "storage_tier" {
  description = "The storage nodes built for the SSD tier: how many, why, and what they hold and deliver."
  value = {
    nodes                        = local.num_storage_nodes
    nodes_for_capacity           = local.storage_nodes_for_capacity
    nodes_for_reads              = local.storage_nodes_for_reads
    raw_bytes_needed             = local.storage_raw_bytes_needed
    raw_bytes                    = local.num_storage_nodes * var.storage_node_bytes
    read_bytes_per_s             = local.num_storage_nodes * var.storage_node_read_bytes_per_s
    read_bytes_per_s_needed      = local.storage.ssd_read_bytes_per_s
    read_bytes_per_s_per_prefill = local.storage.ssd_read_bytes_per_s_per_prefill_gpu * var.gpus_per_prefill_server
  }
}

output "control_plane_nodes" {
  description = "How the NATS, kv-index and control-plane pools were sized."
  value = {
    nats_messages_per_s              = local.nats_messages_per_s
    nats_nodes                       = local.num_nats_nodes
    kv_index_shard_replicas          = local.kv_index_shard_replicas
    kv_index_shard_replicas_per_node = local.kv_index_shard_replicas_per_node
    kv_index_nodes                   = local.num_kv_index_nodes
    control_replicas                 = local.control_replicas
    control_nodes                    = local.num_control_nodes
  }
}

output "decode_super_nodes" {
  description = "The decode super-nodes built: their size, how many, and servers in each."
  value = {
    size              = local.decode_super_node_size
    count             = local.num_decode_super_nodes
    servers_per_super = local.decode_servers_per_super_node
    gpus              = local.num_decode_super_nodes * local.decode_super_node_size
  }
}

output "node_pools" {
  description = "Nodes per pool (prefill, decode, storage, kv_index, nats, control), GPUs per node, decode super-nodes and the services each pool runs: what a cloud module builds."
  value       = local.node_pools

  precondition {
    condition     = local.decode_super_node_size % var.gpus_per_decode_server == 0
    error_message = "A decode super-node's GPUs must be a whole number of decode servers: decode_super_node_size must be a multiple of gpus_per_decode_server."
  }
  precondition {
    condition     = local.kv_index_shard_replicas_per_node >= 1
    error_message = "One kv-index shard does not fit a kv-index node's memory share: add shards (num_index_shards) or memory (kv_index_node_memory_bytes)."
  }
  precondition {
    condition     = var.num_index_shards >= local.control_plane.index_min_shards
    error_message = "A kv-index shard would hold more blocks than its 32-bit row numbers allow: num_index_shards must be at least control_plane.index_min_shards."
  }
}

output "placement" {
  description = "Every service: the node pools that run it and its replicas."
  value       = local.placement
}
