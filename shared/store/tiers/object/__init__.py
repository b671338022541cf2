"""Object tier: records as S3 objects in a bucket shared by every process and host that reaches it."""
