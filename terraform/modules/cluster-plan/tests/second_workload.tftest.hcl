# A second workload, away from every default: shorter prompts, a lower hit rate than the
# prefill rate was measured at, headroom, two SSD reads per hit, 4-GPU prefill servers,
# 36 / 72-GPU super-nodes, replicated storage. Expected figures: `kvfabric plan --json
# --tokens-per-day 20e12 --input-tokens 30000 --output-tokens 500 --hit-rate 0.85
# --prefill-rate 1000000 --prefill-rate-hit-rate 0.9 --decode-rate 10000 --headroom 0.2
# --kv-bytes-per-token 4096 --retention-days 1 --ssd-reads-per-hit-token 2 --block-size 32
# --index-shards 32 --gpus-per-prefill-server 4 --super-node-gpus 36 --super-node-gpus 72`.

variables {
  tokens_per_day                = 20000000000000
  input_tokens_per_request      = 30000
  output_tokens_per_request     = 500
  hit_rate                      = 0.85
  prefill_tokens_per_s_per_gpu  = 1000000
  prefill_rate_hit_rate         = 0.9
  decode_tokens_per_s_per_gpu   = 10000
  headroom_fraction             = 0.2
  kv_bytes_per_token            = 4096
  retention_days                = 1
  ssd_reads_per_hit_token       = 2
  block_size_tokens             = 32
  num_index_shards              = 32
  gpus_per_prefill_server       = 4
  decode_super_node_gpus        = [36, 72]
  decode_super_node_size        = 72
  gpus_per_decode_server        = 4
  storage_node_bytes            = 120000000000000
  storage_node_read_bytes_per_s = 12500000000
  storage_replication_factor    = 2
}

run "second_workload" {
  command = plan

  assert {
    condition = (
      output.traffic.input_tokens_per_day == 19672131147541
      && output.traffic.output_tokens_per_day == 327868852459
      && output.traffic.hit_tokens_per_day == 16721311475410
      && output.traffic.miss_tokens_per_day == 2950819672131
    )
    error_message = "Tokens per day differ from kvfabric plan's."
  }
  assert {
    # 1M tokens/s at 90% hit is 100K misses/s; at 85% hit that serves 666,667 tokens/s.
    condition     = abs(output.fleet.prefill_tokens_per_s_per_gpu / 666666.6666666664 - 1) < 0.000000001
    error_message = "The prefill rate was not rescaled to the hit rate as kvfabric plan does."
  }
  assert {
    condition = (
      output.fleet.num_prefill_gpus == 410 && output.fleet.num_decode_gpus == 456
      && output.fleet.num_pairs == 456 && output.fleet.num_gpus == 866
      && output.fleet.num_prefill_servers == 103
      && output.fleet.num_decode_super_nodes["36"] == 13 && output.fleet.num_decode_super_nodes["72"] == 7
      && abs(output.fleet.prefill_to_decode_ratio / 0.8991228070175439 - 1) < 0.000000001
    )
    error_message = "The fleet differs from kvfabric plan's (410 + 456 GPUs, 103 servers, 13 / 7 super-nodes)."
  }
  assert {
    condition = (
      output.storage.ssd_capacity_bytes == 13429508196720640
      && output.storage.ssd_write_bytes_per_s == 155434122647
      && output.storage.ssd_read_bytes_per_s == 1585428051002
      && output.storage.ssd_read_bytes_per_s_per_prefill_gpu == 2321066667
    )
    error_message = "Storage differs from kvfabric plan's."
  }
  assert {
    condition = (
      output.control_plane.index_bytes == 3073770491804
      && output.control_plane.index_bytes_per_shard == 96055327869
      && output.control_plane.index_min_shards == 24
    )
    error_message = "The kv-index differs from kvfabric plan's."
  }
  assert {
    # Storage: 12.43 PB x 2 copies / 0.9 over 120 TB nodes = 249; reads need 127.
    # kv-index: 12 shard replicas of 96 GB fit 75% of 1,536 GiB; 64 replicas need 6 nodes.
    # NATS: 6.3M messages/s fit 2 servers, so the minimum of 3. Control: 44 + 33 + 2
    # replicas at 2 vCPUs on 64-vCPU nodes: 3.
    condition = (
      output.node_pools.prefill.nodes == 103 && output.node_pools.prefill.gpus_per_node == 4
      && output.node_pools.decode.super_nodes == 7 && output.node_pools.decode.nodes == 126
      && output.node_pools.storage.nodes == 249 && output.storage_tier.nodes_for_reads == 127
      && output.node_pools.kv_index.nodes == 6
      && output.node_pools.nats.nodes == 3
      && output.node_pools.control.nodes == 3
    )
    error_message = "Node pools differ: expected 103 prefill, 126 decode (7 super-nodes), 249 storage, 6 kv-index, 3 NATS, 3 control."
  }
  assert {
    condition = (
      output.placement.prefill.replicas == 412 && output.placement.decode.replicas == 504
      && output.placement["swa-memcache"].replicas == 229
      && output.placement.ingress.replicas == 44 && output.placement.router.replicas == 33
    )
    error_message = "The placement differs from the second workload's."
  }
}
