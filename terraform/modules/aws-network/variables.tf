variable "name" {
  description = "Prefix of every resource's name."
  type        = string
}

variable "vpc_cidr" {
  description = "The VPC's address range."
  type        = string
  default     = "10.40.0.0/16"
}

variable "subnet_cidr" {
  description = "The cluster subnet: every node and, on GPU nodes, every EFA interface takes an address from it (149 p5 servers x 32 EFA = 4,768), so it is large."
  type        = string
  default     = "10.40.0.0/17"
}

variable "availability_zone" {
  description = "The one zone the cluster runs in: cluster placement groups, UltraServers and Capacity Blocks are zonal, and KV moves between every prefill and decode node."
  type        = string
}

variable "client_cidrs" {
  description = "Networks allowed to reach ingress's HTTP port (a load balancer's subnets, a VPN). Never the whole internet: put a load balancer or a gateway in front."
  type        = list(string)
  default     = []
  validation {
    condition     = alltrue([for cidr in var.client_cidrs : !contains(["0.0.0.0/0", "::/0"], cidr)])
    error_message = "client_cidrs must not open ingress to the whole internet (0.0.0.0/0 or ::/0)."
  }
}

variable "ingress_port" {
  description = "Ingress's HTTP port (kvfabric serve ingress --http-port)."
  type        = number
  default     = 8000
}

variable "flow_log_retention_days" {
  description = "Days the VPC flow logs are kept."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags on every resource."
  type        = map(string)
  default     = {}
}
