output "vpc_id" {
  description = "The cluster's VPC."
  value       = aws_vpc.this.id
}

output "subnet_id" {
  description = "The cluster subnet, in var.availability_zone."
  value       = aws_subnet.cluster.id
}

output "subnet_cidr" {
  description = "The cluster subnet's range, for fixed addresses (NATS servers)."
  value       = aws_subnet.cluster.cidr_block
}

output "cluster_security_group_id" {
  description = "Every node's group: all traffic among the nodes."
  value       = aws_security_group.cluster.id
}

output "clients_security_group_id" {
  description = "The group ingress nodes add: the HTTP port from client_cidrs."
  value       = aws_security_group.clients.id
}
