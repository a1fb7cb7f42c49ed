# The workload and the per-GPU rates: the same fields, names, units and defaults as
# `PlanInputs` (services/admin/plan/inputs.py), so the defaults are the reference deployment
# of docs/design.md ('The reference deployment': DeepSeek V4.1 Flash, 155T tokens/day) and
# `kvfabric plan --json` prints what this module computes. Prices, the GPU cost and the
# exchange rate are left out: they size no node (`kvfabric plan` has the money).

variable "tokens_per_day" {
  description = "Tokens per day, input + output (kvfabric plan --tokens-per-day)."
  type        = number
  default     = 155000000000000
  validation {
    condition     = var.tokens_per_day > 0 && floor(var.tokens_per_day) == var.tokens_per_day
    error_message = "tokens_per_day must be an integer > 0."
  }
}

variable "input_tokens_per_request" {
  description = "Average input tokens per request (--input-tokens)."
  type        = number
  default     = 77000
  validation {
    condition     = var.input_tokens_per_request > 0
    error_message = "input_tokens_per_request must be > 0."
  }
}

variable "output_tokens_per_request" {
  description = "Average output tokens per request (--output-tokens). null: 77,000 x 14,000 / 1,500,000 = 718.67, the output at which prefill and decode GPUs balance 1:1 (inputs.py, REFERENCE_OUTPUT_TOKENS_PER_REQUEST)."
  type        = number
  default     = null
  validation {
    condition     = var.output_tokens_per_request == null || try(var.output_tokens_per_request >= 0, false)
    error_message = "output_tokens_per_request must be >= 0."
  }
}

variable "hit_rate" {
  description = "Fraction of input tokens served from the KV store, in [0, 1) (--hit-rate)."
  type        = number
  default     = 0.96
  validation {
    condition     = var.hit_rate >= 0 && var.hit_rate < 1
    error_message = "hit_rate must be in [0, 1)."
  }
}

variable "prefill_tokens_per_s_per_gpu" {
  description = "Input tokens/s one prefill GPU serves at prefill_rate_hit_rate (--prefill-rate)."
  type        = number
  default     = 1500000
  validation {
    condition     = var.prefill_tokens_per_s_per_gpu > 0
    error_message = "prefill_tokens_per_s_per_gpu must be > 0."
  }
}

variable "prefill_rate_hit_rate" {
  description = "The hit rate prefill_tokens_per_s_per_gpu was measured at (--prefill-rate-hit-rate). A prefill GPU is compute-bound on its misses, so at another hit rate it serves rate x (1 - this) / (1 - hit_rate); set it equal to hit_rate to take the rate as is."
  type        = number
  default     = 0.96
  validation {
    condition     = var.prefill_rate_hit_rate >= 0 && var.prefill_rate_hit_rate < 1
    error_message = "prefill_rate_hit_rate must be in [0, 1)."
  }
}

variable "decode_tokens_per_s_per_gpu" {
  description = "Output tokens/s one decode GPU emits (--decode-rate)."
  type        = number
  default     = 14000
  validation {
    condition     = var.decode_tokens_per_s_per_gpu > 0
    error_message = "decode_tokens_per_s_per_gpu must be > 0."
  }
}

variable "headroom_fraction" {
  description = "Extra GPUs over the load, a fraction: 0.25 is +25% (--headroom)."
  type        = number
  default     = 0
  validation {
    condition     = var.headroom_fraction >= 0
    error_message = "headroom_fraction must be >= 0."
  }
}

variable "kv_bytes_per_token" {
  description = "Bytes of KV per token, full-attention layers only (--kv-bytes-per-token)."
  type        = number
  default     = 6144
  validation {
    condition     = var.kv_bytes_per_token > 0 && floor(var.kv_bytes_per_token) == var.kv_bytes_per_token
    error_message = "kv_bytes_per_token must be an integer > 0."
  }
}

variable "retention_days" {
  description = "Days a block stays on the SSD tier (--retention-days)."
  type        = number
  default     = 2
  validation {
    condition     = var.retention_days > 0
    error_message = "retention_days must be > 0."
  }
}

variable "ssd_reads_per_hit_token" {
  description = "SSD reads of each hit token's KV: 1 matches the published 10 TiB/s; 2 where decode's load of the prefix is not absorbed by host DRAM (--ssd-reads-per-hit-token)."
  type        = number
  default     = 1
  validation {
    condition     = var.ssd_reads_per_hit_token > 0 && floor(var.ssd_reads_per_hit_token) == var.ssd_reads_per_hit_token
    error_message = "ssd_reads_per_hit_token must be an integer > 0."
  }
}

variable "block_size_tokens" {
  description = "Tokens per KV block (--block-size)."
  type        = number
  default     = 64
  validation {
    condition     = var.block_size_tokens > 0 && floor(var.block_size_tokens) == var.block_size_tokens
    error_message = "block_size_tokens must be an integer > 0."
  }
}

variable "index_bytes_per_block" {
  description = "kv-index RAM per indexed block; 30 is measured by loadtest/bench_kv_index.py at 10M blocks (--index-bytes-per-block)."
  type        = number
  default     = 30
  validation {
    condition     = var.index_bytes_per_block > 0
    error_message = "index_bytes_per_block must be > 0."
  }
}

variable "num_index_shards" {
  description = "kv-index shards the blocks are split over by hash (--index-shards)."
  type        = number
  default     = 64
  validation {
    condition     = var.num_index_shards > 0 && floor(var.num_index_shards) == var.num_index_shards
    error_message = "num_index_shards must be an integer > 0."
  }
}

variable "gpus_per_prefill_server" {
  description = "GPUs per prefill server (--gpus-per-prefill-server)."
  type        = number
  default     = 8
  validation {
    condition     = var.gpus_per_prefill_server > 0 && floor(var.gpus_per_prefill_server) == var.gpus_per_prefill_server
    error_message = "gpus_per_prefill_server must be an integer > 0."
  }
}

variable "decode_super_node_gpus" {
  description = "GPUs per decode super-node, every size to plan (--super-node-gpus, repeated)."
  type        = list(number)
  default     = [64, 128]
  validation {
    condition = length(var.decode_super_node_gpus) > 0 && alltrue([
      for size in var.decode_super_node_gpus : size > 0 && floor(size) == size
    ])
    error_message = "decode_super_node_gpus must be one or more positive integers."
  }
}

# What the plan does not say and a deployment must: which super-node size is built, and the
# shape and capacity of the nodes outside the GPU fleet. Defaults are the reference
# deployment's hardware where it is published, otherwise an assumption named as one.

variable "decode_super_node_size" {
  description = "The super-node size actually deployed, one of decode_super_node_gpus; null: the first."
  type        = number
  default     = null
  validation {
    condition     = var.decode_super_node_size == null || try(contains(var.decode_super_node_gpus, var.decode_super_node_size), false)
    error_message = "decode_super_node_size must be one of decode_super_node_gpus."
  }
}

variable "gpus_per_decode_server" {
  description = "GPUs per server (instance) inside a decode super-node; a super-node is bought whole, so its size must be a multiple of this."
  type        = number
  default     = 8
  validation {
    condition     = var.gpus_per_decode_server > 0 && floor(var.gpus_per_decode_server) == var.gpus_per_decode_server
    error_message = "gpus_per_decode_server must be an integer > 0."
  }
}

variable "storage_node_bytes" {
  description = "Raw SSD bytes of one storage node. Default: a 3FS storage node as DeepSeek published it, sixteen 14 TiB NVMe SSDs."
  type        = number
  default     = 16 * 14 * 1099511627776
  validation {
    condition     = var.storage_node_bytes > 0
    error_message = "storage_node_bytes must be > 0."
  }
}

variable "storage_node_read_bytes_per_s" {
  description = "Read bandwidth one storage node delivers to clients, bytes/s. Default: DeepSeek's measured 3FS figure, 6.6 TiB/s aggregate read over 180 storage nodes (2 x 200 Gbps each)."
  type        = number
  default     = 6.6 * 1099511627776 / 180
  validation {
    condition     = var.storage_node_read_bytes_per_s > 0
    error_message = "storage_node_read_bytes_per_s must be > 0."
  }
}

variable "storage_replication_factor" {
  description = "Copies of each KV block the distributed file system keeps. 1: a lost block reads as a miss and is recomputed (docs/design.md, 'KV tiers'), never as wrong KV."
  type        = number
  default     = 1
  validation {
    condition     = var.storage_replication_factor >= 1 && floor(var.storage_replication_factor) == var.storage_replication_factor
    error_message = "storage_replication_factor must be an integer >= 1."
  }
}

variable "storage_fill_fraction" {
  description = "Fraction of raw SSD the retention may fill: kv-index starts LRU eviction at its high watermark, 90% of the tier's capacity (docs/design.md, 'KV tiers'), so the retention must fit under it."
  type        = number
  default     = 0.9
  validation {
    condition     = var.storage_fill_fraction > 0 && var.storage_fill_fraction <= 1
    error_message = "storage_fill_fraction must be in (0, 1]."
  }
}

variable "storage_min_nodes" {
  description = "Fewest storage nodes, whatever the load (a distributed file system of one node is no cluster)."
  type        = number
  default     = 3
}

variable "kv_index_replicas" {
  description = "Replicas of each kv-index shard (one queue group per shard; each replica holds the shard in full)."
  type        = number
  default     = 2
  validation {
    condition     = var.kv_index_replicas >= 1 && floor(var.kv_index_replicas) == var.kv_index_replicas
    error_message = "kv_index_replicas must be an integer >= 1."
  }
}

variable "kv_index_node_memory_bytes" {
  description = "RAM of one kv-index node. Default 1,536 GiB, a 2-socket memory-optimised server."
  type        = number
  default     = 1536 * 1073741824
}

variable "kv_index_memory_fraction" {
  description = "Fraction of a kv-index node's RAM its shard replicas may hold (the rest: the OS, the event log being replayed, snapshots in flight)."
  type        = number
  default     = 0.75
  validation {
    condition     = var.kv_index_memory_fraction > 0 && var.kv_index_memory_fraction <= 1
    error_message = "kv_index_memory_fraction must be in (0, 1]."
  }
}

variable "nats_messages_per_request" {
  description = "Core NATS messages per request besides the token stream and the kv-index: GenerateRequest, RouteDecision, DecodeJob + JobAccepted, PrefillJob + PrefillDone, SuffixReady + JobAccepted, InflightNotice, UsageRecord (docs/request-flow.md)."
  type        = number
  default     = 10
}

variable "stream_tokens_per_message" {
  description = "Output tokens per TokenChunk: 1, one chunk per decode step (more with speculative decoding)."
  type        = number
  default     = 1
  validation {
    condition     = var.stream_tokens_per_message > 0
    error_message = "stream_tokens_per_message must be > 0."
  }
}

variable "kv_event_batches_per_request" {
  description = "KvEventBatches a request causes: prefill's and decode's BlocksStored, and their BlocksRemoved when evicted."
  type        = number
  default     = 4
}

variable "nats_messages_per_s_per_node" {
  description = "Messages/s one NATS server delivers. An assumption, not a measurement: nats-server moves several million small messages/s on a large host; measure with `nats bench` on the chosen machine."
  type        = number
  default     = 5000000
  validation {
    condition     = var.nats_messages_per_s_per_node > 0
    error_message = "nats_messages_per_s_per_node must be > 0."
  }
}

variable "nats_min_nodes" {
  description = "Fewest NATS servers: 3, the smallest JetStream cluster that keeps R3 streams through one lost server."
  type        = number
  default     = 3
}

variable "ingress_requests_per_s_per_replica" {
  description = "Requests/s one ingress replica serves. Default: `kvfabric bench ingress` (docs/benchmarks.md, 'ingress'), 176/s with the whole mock cluster on 2 cores, so a floor."
  type        = number
  default     = 176
  validation {
    condition     = var.ingress_requests_per_s_per_replica > 0
    error_message = "ingress_requests_per_s_per_replica must be > 0."
  }
}

variable "router_requests_per_s_per_replica" {
  description = "Requests/s one router replica serves. Default: the same benchmark's peer, shared.client straight to the router, 234/s on 2 cores: a floor."
  type        = number
  default     = 234
  validation {
    condition     = var.router_requests_per_s_per_replica > 0
    error_message = "router_requests_per_s_per_replica must be > 0."
  }
}

variable "billing_replicas" {
  description = "Billing replicas (they share one durable consumer and one ledger database)."
  type        = number
  default     = 2
}

variable "control_node_vcpus" {
  description = "vCPUs of one control-plane node (ingress, router, billing)."
  type        = number
  default     = 64
}

variable "control_vcpus_per_replica" {
  description = "vCPUs one ingress, router or billing replica takes: a Python process runs on one core, two vCPUs with its hyperthread."
  type        = number
  default     = 2
}

variable "control_min_nodes" {
  description = "Fewest control-plane nodes, so that losing one leaves ingress and router serving."
  type        = number
  default     = 2
}
