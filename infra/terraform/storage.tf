# Credentials of the durable checkpoint store behind the campaign's durable_url, loaded as
# environment variables by every flow-run pod (infra/k8s/base-job-template.json) and every rank
# (tasks/kubernetes.py), which megatrain.storage reads: e.g. { HADOOP_USER_NAME = "megatrain" }
# for hdfs://, or { AWS_ACCESS_KEY_ID = "...", AWS_SECRET_ACCESS_KEY = "...",
# MEGATRAIN_S3_ENDPOINT = "https://..." } for s3://. Both pod kinds treat it as optional.
resource "kubernetes_secret_v1" "storage" {
  metadata {
    name      = "megatrain-storage"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  data = var.storage_env
}
