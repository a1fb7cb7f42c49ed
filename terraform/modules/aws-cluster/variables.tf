variable "name" {
  description = "The cluster's name, the prefix of every resource's name."
  type        = string
}

variable "node_pools" {
  description = "cluster-plan's node_pools output: nodes, GPUs per node, super-nodes and services of each pool."
  type = map(object({
    nodes                = number
    gpus_per_node        = number
    super_nodes          = number
    nodes_per_super_node = number
    services             = list(string)
  }))
  validation {
    condition     = length(setsubtract(["prefill", "decode", "storage", "kv_index", "nats", "control"], keys(var.node_pools))) == 0
    error_message = "node_pools must have the pools cluster-plan outputs: prefill, decode, storage, kv_index, nats, control."
  }
}

variable "availability_zone" {
  description = "The one zone of the cluster; the Capacity Blocks must be in it."
  type        = string
}

variable "vpc_cidr" {
  description = "The VPC's address range."
  type        = string
  default     = "10.40.0.0/16"
}

variable "subnet_cidr" {
  description = "The cluster subnet's range."
  type        = string
  default     = "10.40.0.0/17"
}

variable "client_cidrs" {
  description = "Networks allowed to reach ingress's HTTP port (never 0.0.0.0/0)."
  type        = list(string)
  default     = []
}

variable "ingress_port" {
  description = "Ingress's HTTP port."
  type        = number
  default     = 8000
}

# --- instance types: the reference shape on AWS ---------------------------------------------

variable "prefill_instance_type" {
  description = "8-GPU prefill servers: p5.48xlarge (8 x H100, 32 EFA network cards, 3,200 Gbps); p5e/p5en.48xlarge carry H200s."
  type        = string
  default     = "p5.48xlarge"
}

variable "prefill_efa_interfaces" {
  description = "EFA interfaces per prefill server, one per network card (p5.48xlarge: 32; p5en.48xlarge: 16)."
  type        = number
  default     = 32
}

variable "decode_instance_type" {
  description = "Decode super-node members: p6e-gb200.36xlarge (4 B200 GPUs), sold only as P6e-GB200 UltraServers of 18 (u-p6e-gb200x72, one 72-GPU NVLink domain) or 9 (u-p6e-gb200x36) instances."
  type        = string
  default     = "p6e-gb200.36xlarge"
}

variable "decode_efa_interfaces" {
  description = "EFA interfaces per decode instance: 4, one 400 Gbps EFA per GPU (an UltraServer's 28.8 Tbps over 72 GPUs). Check the instance's network cards (aws ec2 describe-instance-types) before relying on it."
  type        = number
  default     = 4
}

variable "storage_instance_type" {
  description = "Storage nodes of the distributed file system: i7ie.48xlarge (16 x 7,500 GB NVMe, 100 Gbps)."
  type        = string
  default     = "i7ie.48xlarge"
}

variable "storage_efa_interfaces" {
  description = "EFA interfaces per storage node (RDMA for the file system's reads); 0 for plain ENA."
  type        = number
  default     = 1
}

variable "kv_index_instance_type" {
  description = "kv-index nodes: memory-optimised, r7i.48xlarge (1,536 GiB), the RAM cluster-plan's kv_index_node_memory_bytes assumes."
  type        = string
  default     = "r7i.48xlarge"
}

variable "nats_instance_type" {
  description = "NATS servers: general-purpose, network-heavy."
  type        = string
  default     = "m7i.16xlarge"
}

variable "control_instance_type" {
  description = "Control-plane nodes (ingress, router, billing): m7i.16xlarge, the 64 vCPUs cluster-plan's control_node_vcpus assumes."
  type        = string
  default     = "m7i.16xlarge"
}

# --- images and capacity ------------------------------------------------------------------

variable "gpu_image_id" {
  description = "x86_64 AMI of the prefill servers (NVIDIA driver, EFA software, kvfabric), or resolve:ssm:<parameter>."
  type        = string
}

variable "gpu_arm64_image_id" {
  description = "arm64 AMI of the decode instances (p6e-gb200 has Grace CPUs), or resolve:ssm:<parameter>."
  type        = string
}

variable "cpu_image_id" {
  description = "x86_64 AMI of the storage, kv-index, NATS and control-plane nodes."
  type        = string
  default     = "resolve:ssm:/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
}

variable "decode_capacity_block_ids" {
  description = "Capacity Block reservation ids, one per decode super-node (UltraServer), in order; empty to launch without (UltraServers are sold through Capacity Blocks, so a real decode pool needs them)."
  type        = list(string)
  default     = []
}

variable "prefill_capacity_block_ids" {
  description = "Capacity Block reservation ids for the prefill servers, prefill_nodes_per_capacity_block each; empty for On-Demand or open reservations."
  type        = list(string)
  default     = []
}

variable "prefill_nodes_per_capacity_block" {
  description = "Prefill servers per Capacity Block (a block holds at most 64 instances)."
  type        = number
  default     = 64
}

variable "nats_client_port" {
  description = "NATS client port."
  type        = number
  default     = 4222
}

variable "tags" {
  description = "Tags on every resource."
  type        = map(string)
  default     = {}
}
