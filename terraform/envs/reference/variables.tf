variable "region" {
  description = "AWS region: one that offers P5 and P6e-GB200 capacity."
  type        = string
  default     = "us-east-1"
}

variable "availability_zone" {
  description = "The cluster's one zone; the Capacity Blocks must be in it."
  type        = string
  default     = "us-east-1a"
}

variable "client_cidrs" {
  description = "Networks that may reach ingress (a load balancer's subnets, a VPN); never 0.0.0.0/0."
  type        = list(string)
  default     = []
}

variable "gpu_image_id" {
  description = "x86_64 AMI of the prefill servers (NVIDIA driver, EFA, kvfabric)."
  type        = string
}

variable "gpu_arm64_image_id" {
  description = "arm64 AMI of the decode instances (Grace CPUs)."
  type        = string
}

variable "decode_capacity_block_ids" {
  description = "One Capacity Block per UltraServer (u-p6e-gb200x72), as many as output.plan.decode_super_nodes.count."
  type        = list(string)
  default     = []
}

variable "prefill_capacity_block_ids" {
  description = "Capacity Blocks of p5.48xlarge for the prefill servers, 64 servers each; empty for On-Demand."
  type        = list(string)
  default     = []
}
