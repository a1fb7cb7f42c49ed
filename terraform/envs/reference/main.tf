# The reference deployment (docs/design.md, 'The reference deployment': 155T tokens/day at a
# 96% hit rate) on AWS: cluster-plan with the reference workload and AWS's hardware shape,
# then aws-cluster builds its node pools.

provider "aws" {
  region = var.region
  default_tags {
    tags = local.tags
  }
}

locals {
  name = "kvfabric-ref"
  tags = { "kvfabric:cluster" = local.name, "kvfabric:env" = "reference" }

  # What the plan must know of AWS's machines (AWS's published instance specifications).
  hardware = {
    # p5.48xlarge: 8 H100s, the reference's 8-GPU prefill server.
    gpus_per_prefill_server = 8
    # u-p6e-gb200x72: 18 p6e-gb200.36xlarge of 4 GPUs, one 72-GPU NVLink domain; the
    # closest AWS offers to the reference's 64-GPU decode super-node.
    gpus_per_decode_server = 4
    decode_super_node_gpus = 72
    # i7ie.48xlarge: 16 x 7,500 GB NVMe; 100 Gbps of network is what it can serve.
    storage_node_bytes            = 16 * 7500 * 1000000000
    storage_node_read_bytes_per_s = 100 * 1000000000 / 8
    # r7i.48xlarge: 1,536 GiB of RAM for kv-index shard replicas.
    kv_index_node_memory_bytes = 1536 * 1073741824
    # m7i.16xlarge: 64 vCPUs for ingress, router and billing replicas.
    control_node_vcpus = 64
  }
}

# The workload is cluster-plan's defaults, the reference's; only the hardware is AWS's.
# `kvfabric plan` with the same inputs prints the same fleet.
module "plan" {
  source = "../../modules/cluster-plan"

  gpus_per_prefill_server = local.hardware.gpus_per_prefill_server
  # Plan the reference's 64 and 128 as well, to compare; build 72.
  decode_super_node_gpus        = [64, 128, local.hardware.decode_super_node_gpus]
  decode_super_node_size        = local.hardware.decode_super_node_gpus
  gpus_per_decode_server        = local.hardware.gpus_per_decode_server
  storage_node_bytes            = local.hardware.storage_node_bytes
  storage_node_read_bytes_per_s = local.hardware.storage_node_read_bytes_per_s
  kv_index_node_memory_bytes    = local.hardware.kv_index_node_memory_bytes
  control_node_vcpus            = local.hardware.control_node_vcpus
}

module "cluster" {
  source = "../../modules/aws-cluster"

  name                       = local.name
  node_pools                 = module.plan.node_pools
  availability_zone          = var.availability_zone
  client_cidrs               = var.client_cidrs
  gpu_image_id               = var.gpu_image_id
  gpu_arm64_image_id         = var.gpu_arm64_image_id
  decode_capacity_block_ids  = var.decode_capacity_block_ids
  prefill_capacity_block_ids = var.prefill_capacity_block_ids
}
