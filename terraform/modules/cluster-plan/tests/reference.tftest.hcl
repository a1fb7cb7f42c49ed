# The reference deployment (docs/design.md, 'The reference deployment'): the module's
# defaults. Expected figures are `kvfabric plan --json` with its defaults; counts exactly,
# rates and loads to 1e-9 relative, written 0.000000001 (Terraform computes in arbitrary
# precision, Python in float64; checkov's HCL parser reads no negative exponent). tests/deploy/test_terraform.py compares every figure against the CLI as well.

run "reference_plan" {
  command = plan

  assert {
    condition = (
      output.traffic.input_tokens_per_day == 153566710700132
      && output.traffic.output_tokens_per_day == 1433289299868
      && output.traffic.hit_tokens_per_day == 147424042272127
      && output.traffic.miss_tokens_per_day == 6142668428005
    )
    error_message = "Tokens per day differ from kvfabric plan's."
  }
  assert {
    condition     = abs(output.traffic.requests_per_s / 23083.01928513289 - 1) < 0.000000001
    error_message = "requests/s differ from kvfabric plan's 23,083.02."
  }
  assert {
    condition = (
      output.fleet.num_prefill_gpus == 1185 && output.fleet.num_decode_gpus == 1185
      && output.fleet.num_pairs == 1185 && output.fleet.num_gpus == 2370
      && output.fleet.num_prefill_servers == 149
      && output.fleet.num_decode_super_nodes["64"] == 19 && output.fleet.num_decode_super_nodes["128"] == 10
      && output.fleet.prefill_to_decode_ratio == 1
    )
    error_message = "The fleet is not 1,185 + 1,185 GPUs, 149 prefill servers, 19 / 10 super-nodes of 64 / 128."
  }
  assert {
    condition     = abs(output.fleet.prefill_gpus_busy / 1184.9283233034876 - 1) < 0.000000001
    error_message = "The prefill load differs from kvfabric plan's 1,184.93 GPUs."
  }
  assert {
    condition = (
      output.storage.new_kv_tokens_per_day == 7575957727873
      && output.storage.ssd_capacity_bytes == 93093368560103424
      && output.storage.ssd_write_bytes_per_s == 538734771760
      && output.storage.ssd_read_bytes_per_s == 10483487450462
      && output.storage.ssd_read_bytes_per_s_per_prefill_gpu == 8847360000
    )
    error_message = "Storage differs from kvfabric plan's (82.68 PiB, 9.53 TiB/s read)."
  }
  assert {
    condition = (
      output.control_plane.index_bytes == 7102460369881
      && output.control_plane.index_bytes_per_day_of_retention == 3551230184941
      && output.control_plane.index_bytes_per_shard == 110975943280
      && output.control_plane.index_min_shards == 56
      && abs(output.control_plane.kv_events_per_s / 2740146.747639251 - 1) < 0.000000001
    )
    error_message = "The control plane differs from kvfabric plan's (6.46 TiB kv-index, 56 shards at least)."
  }

  # The deployment on the module's default hardware: 3FS-like storage nodes (224 TiB,
  # 6.6 TiB/s over 180 nodes), 8-GPU decode servers in 64-GPU super-nodes.
  assert {
    condition = (
      output.node_pools.prefill.nodes == 149 && output.node_pools.prefill.gpus_per_node == 8
      && output.node_pools.decode.super_nodes == 19 && output.node_pools.decode.nodes == 152
      && output.node_pools.storage.nodes == 420
      && output.node_pools.kv_index.nodes == 12
      && output.node_pools.nats.nodes == 7
      && output.node_pools.control.nodes == 8
    )
    error_message = "Node pools: expected 149 prefill, 152 decode (19 super-nodes), 420 storage, 12 kv-index, 7 NATS, 8 control nodes."
  }
  assert {
    # 82.68 PiB under a 90% watermark is 91.9 PiB raw: the published "100 PiB of SSD".
    condition = (
      output.storage_tier.nodes_for_capacity == 420 && output.storage_tier.nodes_for_reads == 261
      && output.storage_tier.read_bytes_per_s >= output.storage.ssd_read_bytes_per_s
    )
    error_message = "The storage tier is not sized by capacity (420 nodes) over reads (261)."
  }
  assert {
    condition = (
      output.placement.prefill.replicas == 1192 && output.placement.decode.replicas == 1216
      && output.placement["swa-memcache"].replicas == 301
      && output.placement["kv-index"].replicas == 128
      && output.placement.ingress.replicas == 132 && output.placement.router.replicas == 99
      && output.placement.billing.replicas == 2 && output.placement.nats.replicas == 7
      && output.placement.ingress.pools == ["control"]
      && output.placement["swa-memcache"].pools == ["prefill", "decode"]
    )
    error_message = "The placement of the services differs from the reference's."
  }
}

# The same workload on AWS's hardware shape, as terraform/envs/reference builds it: decode
# on GB200 NVL72 UltraServers (18 x p6e-gb200.36xlarge, 4 GPUs each), storage on
# i7ie.48xlarge (120 TB NVMe, 100 Gbps).
run "reference_on_aws_hardware" {
  command = plan

  variables {
    decode_super_node_gpus        = [64, 128, 72]
    decode_super_node_size        = 72
    gpus_per_decode_server        = 4
    storage_node_bytes            = 120000000000000
    storage_node_read_bytes_per_s = 12500000000
  }

  assert {
    condition = (
      output.fleet.num_decode_super_nodes["64"] == 19 && output.fleet.num_decode_super_nodes["128"] == 10
      && output.fleet.num_decode_super_nodes["72"] == 17
    )
    error_message = "Super-nodes of 64 / 128 / 72 should be 19 / 10 / 17."
  }
  assert {
    condition = (
      output.decode_super_nodes.count == 17 && output.decode_super_nodes.servers_per_super == 18
      && output.node_pools.decode.nodes == 306 && output.placement.decode.replicas == 1224
    )
    error_message = "Decode on AWS should be 17 UltraServers of 18 instances (306), 1,224 GPUs."
  }
  assert {
    condition = (
      output.node_pools.storage.nodes == 862 && output.storage_tier.nodes_for_capacity == 862
      && output.storage_tier.nodes_for_reads == 839
    )
    error_message = "Storage on i7ie.48xlarge should be 862 nodes (capacity), 839 for reads."
  }
  assert {
    condition     = output.fleet.num_prefill_gpus == 1185 && output.node_pools.prefill.nodes == 149
    error_message = "The hardware shape must not change the GPUs the load needs."
  }
}
