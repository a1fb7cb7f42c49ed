# Inputs kvfabric plan refuses are refused here too, and a plan that cannot be deployed
# fails its node_pools output rather than building a cluster that cannot work.

run "hit_rate_out_of_range" {
  command = plan
  variables {
    hit_rate = 1
  }
  expect_failures = [var.hit_rate]
}

run "fractional_tokens_per_day" {
  command = plan
  variables {
    tokens_per_day = 1.5
  }
  expect_failures = [var.tokens_per_day]
}

run "super_node_size_not_planned" {
  command = plan
  variables {
    decode_super_node_size = 72
  }
  expect_failures = [var.decode_super_node_size]
}

run "super_node_not_whole_servers" {
  command = plan
  variables {
    decode_super_node_gpus = [36]
    gpus_per_decode_server = 8
  }
  expect_failures = [output.node_pools]
}

run "too_few_index_shards" {
  # The reference needs 56 shards at least (32-bit row numbers per shard).
  command = plan
  variables {
    num_index_shards = 32
  }
  expect_failures = [output.node_pools]
}

run "no_output_tokens" {
  # Prefill only: no decode GPUs, no ratio (kvfabric plan prints n/a).
  command = plan
  variables {
    output_tokens_per_request = 0
  }
  assert {
    condition = (
      output.fleet.num_decode_gpus == 0 && output.fleet.prefill_to_decode_ratio == null
      && output.node_pools.decode.nodes == 0
    )
    error_message = "Without output tokens there is no decode GPU and no P:D ratio."
  }
}
