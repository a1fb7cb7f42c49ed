variable "cluster_name" {
  description = "The cluster's name, the prefix of every resource's name."
  type        = string
}

variable "pool" {
  description = "The pool's name (cluster-plan's node_pools key: prefill, decode, storage, kv_index, nats, control)."
  type        = string
}

variable "node_count" {
  description = "Nodes in the pool (cluster-plan's node_pools[pool].nodes)."
  type        = number
  validation {
    condition     = var.node_count >= 0 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number >= 0."
  }
}

variable "instance_type" {
  description = "EC2 instance type of every node in the pool."
  type        = string
}

variable "image_id" {
  description = "AMI of the pool, or `resolve:ssm:<parameter>`. It must carry kvfabric and start the services /etc/kvfabric/node.env names (see docs/deploy.md); GPU pools need NVIDIA drivers and the EFA software, and the decode pool's p6e-gb200 is arm64."
  type        = string
}

variable "subnet_id" {
  description = "The cluster subnet."
  type        = string
}

variable "availability_zone" {
  description = "The subnet's zone."
  type        = string
}

variable "security_group_ids" {
  description = "Security groups of every interface."
  type        = list(string)
}

variable "efa_interfaces" {
  description = "EFA interfaces per node, one per network card (p5.48xlarge: 32); 0 for one plain ENA interface."
  type        = number
  default     = 0
}

variable "placement_strategy" {
  description = "Placement group strategy: `cluster` (one low-latency, high-bandwidth network segment: GPU and storage nodes), `spread` (distinct racks, at most 7 nodes: NATS), or null for none (Capacity Blocks place their own instances)."
  type        = string
  default     = null
  validation {
    condition     = var.placement_strategy == null || try(contains(["cluster", "spread"], var.placement_strategy), false)
    error_message = "placement_strategy must be cluster, spread or null."
  }
}

variable "market_type" {
  description = "null for On-Demand (or an open reservation); `capacity-block` for instances in EC2 Capacity Blocks for ML, the way UltraServers are sold."
  type        = string
  default     = null
}

variable "capacity_reservation_ids" {
  description = "Capacity Reservations (e.g. one Capacity Block per UltraServer) the nodes launch into, nodes_per_capacity_reservation consecutive nodes each; empty for none."
  type        = list(string)
  default     = []
}

variable "nodes_per_capacity_reservation" {
  description = "Consecutive nodes per entry of capacity_reservation_ids (a decode super-node's instances: 18 for u-p6e-gb200x72)."
  type        = number
  default     = 1
}

variable "capacity_reservation_resource_group_arn" {
  description = "A resource group of On-Demand Capacity Reservations to launch into, instead of capacity_reservation_ids; null for none."
  type        = string
  default     = null
}

variable "private_ips" {
  description = "Fixed private addresses, one per node, for a pool others must find before it exists (NATS); only without EFA. Empty: assigned by the subnet."
  type        = list(string)
  default     = []
}

variable "iam_instance_profile_name" {
  description = "Instance profile of every node."
  type        = string
}

variable "kms_key_arn" {
  description = "KMS key encrypting the root volumes."
  type        = string
}

variable "root_volume_gib" {
  description = "Root volume size, GiB (images, model weights, logs; the KV store is on the file system)."
  type        = number
  default     = 200
}

variable "user_data" {
  description = "Cloud-init user data (plain text; encoded here)."
  type        = string
  default     = ""
}

variable "tags" {
  description = "Tags on every resource."
  type        = map(string)
  default     = {}
}
