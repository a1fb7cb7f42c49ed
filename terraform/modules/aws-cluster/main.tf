# The whole cluster on AWS from cluster-plan's node_pools: the network, an encryption key
# for the volumes, the nodes' role, and one aws-node-pool per pool, each with the instance
# type, network and placement its work needs:
#
#   pool      instance (default)              placement                 why
#   prefill   p5.48xlarge, 32 EFA             cluster placement group   KV to decode over RDMA, hits from storage
#   decode    p6e-gb200.36xlarge, 4 EFA       UltraServer Capacity Blocks: an UltraServer is the super-node
#   storage   i7ie.48xlarge, 1 EFA            cluster placement group   read bandwidth to every GPU node
#   kv_index  r7i.48xlarge                    none                      RAM for the shard replicas
#   nats      m7i.16xlarge, fixed addresses   spread (up to 7)          one rack's loss keeps a majority
#   control   m7i.16xlarge, + clients group   none                      stateless ingress, router, billing
#
# Every node gets /etc/kvfabric/node.env saying its pool, the services it runs and the NATS
# servers; the image starts them (docs/deploy.md).

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

module "network" {
  source            = "../aws-network"
  name              = var.name
  vpc_cidr          = var.vpc_cidr
  subnet_cidr       = var.subnet_cidr
  availability_zone = var.availability_zone
  client_cidrs      = var.client_cidrs
  ingress_port      = var.ingress_port
  tags              = var.tags
}

# --- the volumes' key and the nodes' role ---------------------------------------------------

resource "aws_kms_key" "volumes" {
  description         = "${var.name}: node root volumes"
  enable_key_rotation = true
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      # The account's IAM policies decide who uses the key (EC2 does so on the launcher's behalf).
      Sid       = "AccountAdministers"
      Effect    = "Allow"
      Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
  tags = var.tags
}

resource "aws_iam_role" "node" {
  name = "${var.name}-node"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
  tags = var.tags
}

# Shell access through Systems Manager instead of SSH: no key pairs, no port 22.
resource "aws_iam_role_policy_attachment" "node_ssm" {
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "node" {
  name = "${var.name}-node"
  role = aws_iam_role.node.name
  tags = var.tags
}

# --- what every node is told ----------------------------------------------------------------

locals {
  # NATS servers get fixed addresses, so every node's configuration names them before they
  # exist (the subnet's first addresses are AWS's; 16 on are free).
  nats_ips = [for i in range(var.node_pools.nats.nodes) : cidrhost(var.subnet_cidr, 16 + i)]
  nats_url = join(",", [for ip in local.nats_ips : "nats://${ip}:${var.nats_client_port}"])
  # The shared store's mount on every GPU node (docs/design.md, 'KV tiers').
  store_dir = "/mnt/kvstore"

  user_data = {
    for pool, spec in var.node_pools : pool => <<-EOT
      #cloud-config
      write_files:
        - path: /etc/kvfabric/node.env
          permissions: "0644"
          content: |
            KVF_CLUSTER=${var.name}
            KVF_POOL=${pool}
            KVF_SERVICES="${join(" ", spec.services)}"
            KVF_NATS_URL=${local.nats_url}
            KVF_NATS_ROUTES=${join(",", [for ip in local.nats_ips : "nats-route://${ip}:6222"])}
            KVF_PREFILL_STORE_DIR=${local.store_dir}
            KVF_DECODE_STORE_DIR=${local.store_dir}
            KVF_METRICS_HOST=0.0.0.0
    EOT
  }

  common = {
    cluster_name              = var.name
    subnet_id                 = module.network.subnet_id
    availability_zone         = var.availability_zone
    iam_instance_profile_name = aws_iam_instance_profile.node.name
    kms_key_arn               = aws_kms_key.volumes.arn
  }
}

# --- the pools ------------------------------------------------------------------------------

module "prefill" {
  source                         = "../aws-node-pool"
  pool                           = "prefill"
  node_count                     = var.node_pools.prefill.nodes
  instance_type                  = var.prefill_instance_type
  image_id                       = var.gpu_image_id
  efa_interfaces                 = var.prefill_efa_interfaces
  placement_strategy             = "cluster"
  market_type                    = length(var.prefill_capacity_block_ids) > 0 ? "capacity-block" : null
  capacity_reservation_ids       = var.prefill_capacity_block_ids
  nodes_per_capacity_reservation = var.prefill_nodes_per_capacity_block
  security_group_ids             = [module.network.cluster_security_group_id]
  user_data                      = local.user_data.prefill
  cluster_name                   = local.common.cluster_name
  subnet_id                      = local.common.subnet_id
  availability_zone              = local.common.availability_zone
  iam_instance_profile_name      = local.common.iam_instance_profile_name
  kms_key_arn                    = local.common.kms_key_arn
  tags                           = var.tags
}

# One Capacity Block per super-node: an UltraServer's 18 instances are one NVLink domain,
# and Capacity Blocks place their instances themselves, so no placement group.
module "decode" {
  source                         = "../aws-node-pool"
  pool                           = "decode"
  node_count                     = var.node_pools.decode.nodes
  instance_type                  = var.decode_instance_type
  image_id                       = var.gpu_arm64_image_id
  efa_interfaces                 = var.decode_efa_interfaces
  placement_strategy             = null
  market_type                    = length(var.decode_capacity_block_ids) > 0 ? "capacity-block" : null
  capacity_reservation_ids       = var.decode_capacity_block_ids
  nodes_per_capacity_reservation = max(1, var.node_pools.decode.nodes_per_super_node)
  security_group_ids             = [module.network.cluster_security_group_id]
  user_data                      = local.user_data.decode
  cluster_name                   = local.common.cluster_name
  subnet_id                      = local.common.subnet_id
  availability_zone              = local.common.availability_zone
  iam_instance_profile_name      = local.common.iam_instance_profile_name
  kms_key_arn                    = local.common.kms_key_arn
  tags                           = var.tags
}

module "storage" {
  source                    = "../aws-node-pool"
  pool                      = "storage"
  node_count                = var.node_pools.storage.nodes
  instance_type             = var.storage_instance_type
  image_id                  = var.cpu_image_id
  efa_interfaces            = var.storage_efa_interfaces
  placement_strategy        = "cluster"
  security_group_ids        = [module.network.cluster_security_group_id]
  user_data                 = local.user_data.storage
  cluster_name              = local.common.cluster_name
  subnet_id                 = local.common.subnet_id
  availability_zone         = local.common.availability_zone
  iam_instance_profile_name = local.common.iam_instance_profile_name
  kms_key_arn               = local.common.kms_key_arn
  tags                      = var.tags
}

module "kv_index" {
  source                    = "../aws-node-pool"
  pool                      = "kv_index"
  node_count                = var.node_pools.kv_index.nodes
  instance_type             = var.kv_index_instance_type
  image_id                  = var.cpu_image_id
  security_group_ids        = [module.network.cluster_security_group_id]
  user_data                 = local.user_data.kv_index
  cluster_name              = local.common.cluster_name
  subnet_id                 = local.common.subnet_id
  availability_zone         = local.common.availability_zone
  iam_instance_profile_name = local.common.iam_instance_profile_name
  kms_key_arn               = local.common.kms_key_arn
  tags                      = var.tags
}

module "nats" {
  source             = "../aws-node-pool"
  pool               = "nats"
  node_count         = var.node_pools.nats.nodes
  instance_type      = var.nats_instance_type
  image_id           = var.cpu_image_id
  private_ips        = local.nats_ips
  placement_strategy = var.node_pools.nats.nodes <= 7 ? "spread" : null
  security_group_ids = [module.network.cluster_security_group_id]
  # JetStream keeps the usage log and the KV event log on the root volume.
  root_volume_gib           = 1000
  user_data                 = local.user_data.nats
  cluster_name              = local.common.cluster_name
  subnet_id                 = local.common.subnet_id
  availability_zone         = local.common.availability_zone
  iam_instance_profile_name = local.common.iam_instance_profile_name
  kms_key_arn               = local.common.kms_key_arn
  tags                      = var.tags
}

module "control" {
  source                    = "../aws-node-pool"
  pool                      = "control"
  node_count                = var.node_pools.control.nodes
  instance_type             = var.control_instance_type
  image_id                  = var.cpu_image_id
  security_group_ids        = [module.network.cluster_security_group_id, module.network.clients_security_group_id]
  user_data                 = local.user_data.control
  cluster_name              = local.common.cluster_name
  subnet_id                 = local.common.subnet_id
  availability_zone         = local.common.availability_zone
  iam_instance_profile_name = local.common.iam_instance_profile_name
  kms_key_arn               = local.common.kms_key_arn
  tags                      = var.tags
}
