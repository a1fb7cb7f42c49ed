terraform {
  required_version = ">= 1.9"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.80, < 7.0"
    }
  }
  # State stays local until a backend is configured here, e.g. an encrypted S3 bucket
  # with locking: backend "s3" { bucket = "...", key = "kvfabric/reference.tfstate", ... }.
}
