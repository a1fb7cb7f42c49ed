# The cluster's network: one VPC, one private subnet in one zone, flow logs, and two
# security groups: `cluster` (every node, all traffic among themselves: EFA requires it,
# and NATS, NIXL and the file system all run node to node) and `clients` (ingress's port,
# from the networks named in client_cidrs only). Nothing here is reachable from the internet
# and no node has a public address; egress beyond the VPC (NAT, VPC endpoints) is the
# operator's to add for images and model weights.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(var.tags, { Name = var.name })
}

# The default security group allows nothing, so nothing lands in it by accident.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
  tags   = merge(var.tags, { Name = "${var.name}-default-deny" })
}

resource "aws_subnet" "cluster" {
  vpc_id                  = aws_vpc.this.id
  cidr_block              = var.subnet_cidr
  availability_zone       = var.availability_zone
  map_public_ip_on_launch = false
  tags                    = merge(var.tags, { Name = "${var.name}-cluster" })
}

# Only the VPC's local route: the subnet is private.
resource "aws_route_table" "cluster" {
  vpc_id = aws_vpc.this.id
  tags   = merge(var.tags, { Name = "${var.name}-cluster" })
}

resource "aws_route_table_association" "cluster" {
  subnet_id      = aws_subnet.cluster.id
  route_table_id = aws_route_table.cluster.id
}

# --- flow logs, encrypted with a key of their own ------------------------------------------

resource "aws_kms_key" "logs" {
  description         = "${var.name}: VPC flow logs"
  enable_key_rotation = true
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministers"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogsEncrypts"
        Effect    = "Allow"
        Principal = { Service = "logs.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnLike = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${data.aws_partition.current.partition}:logs:*:${data.aws_caller_identity.current.account_id}:log-group:/kvfabric/${var.name}/*"
          }
        }
      },
    ]
  })
  tags = var.tags
}

resource "aws_cloudwatch_log_group" "flow_logs" {
  name              = "/kvfabric/${var.name}/vpc-flow-logs"
  retention_in_days = var.flow_log_retention_days
  kms_key_id        = aws_kms_key.logs.arn
  tags              = var.tags
}

resource "aws_iam_role" "flow_logs" {
  name = "${var.name}-vpc-flow-logs"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "vpc-flow-logs.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
  tags = var.tags
}

resource "aws_iam_role_policy" "flow_logs" {
  name = "write-flow-logs"
  role = aws_iam_role.flow_logs.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect   = "Allow"
      Action   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
      Resource = ["${aws_cloudwatch_log_group.flow_logs.arn}:*"]
    }]
  })
}

resource "aws_flow_log" "vpc" {
  vpc_id          = aws_vpc.this.id
  traffic_type    = "ALL"
  log_destination = aws_cloudwatch_log_group.flow_logs.arn
  iam_role_arn    = aws_iam_role.flow_logs.arn
  tags            = var.tags
}

# --- security groups ----------------------------------------------------------------------

resource "aws_security_group" "cluster" {
  # checkov:skip=CKV2_AWS_5: attached to every node by aws-node-pool (launch template interfaces, instances), through module outputs checkov's graph does not follow
  name        = "${var.name}-cluster"
  description = "kvfabric nodes: all traffic among themselves (EFA, NATS, NIXL, the file system)"
  vpc_id      = aws_vpc.this.id

  ingress {
    description = "From every cluster node (EFA needs all protocols from its own group)"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    self        = true
  }
  egress {
    description = "To every cluster node (EFA needs all protocols to its own group)"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    self        = true
  }
  egress {
    description = "HTTPS inside the VPC: interface endpoints (SSM, S3, ECR) the operator adds"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
  tags = merge(var.tags, { Name = "${var.name}-cluster" })
}

resource "aws_security_group" "clients" {
  # checkov:skip=CKV2_AWS_5: attached to the control pool's nodes by aws-cluster through aws-node-pool, module outputs checkov's graph does not follow
  name        = "${var.name}-clients"
  description = "kvfabric ingress: its HTTP port from the client networks only"
  vpc_id      = aws_vpc.this.id

  dynamic "ingress" {
    for_each = length(var.client_cidrs) > 0 ? [1] : []
    content {
      description = "Ingress HTTP API (OpenAI and Anthropic protocols) from the client networks"
      from_port   = var.ingress_port
      to_port     = var.ingress_port
      protocol    = "tcp"
      cidr_blocks = var.client_cidrs
    }
  }
  tags = merge(var.tags, { Name = "${var.name}-clients" })
}
