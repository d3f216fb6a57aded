variable "kubeconfig_path" {
  description = "kubeconfig of the cluster to set up"
  type        = string
  default     = "~/.kube/config"
}

variable "kube_context" {
  description = "kubeconfig context (null: the current one)"
  type        = string
  default     = null
}

variable "namespace" {
  description = "namespace of everything megatrain runs; the work pool's jobs and tasks/kubernetes.py use it"
  type        = string
  default     = "megatrain"
}

variable "service_account" {
  description = "service account of the flow-run pods (base job template's service_account_name)"
  type        = string
  default     = "megatrain"
}

variable "work_pool_name" {
  description = "Prefect work pool of the `cluster` deployment in prefect.yaml"
  type        = string
  default     = "megatrain-k8s"
}

variable "prefect_api_url" {
  description = "an existing Prefect API (e.g. https://prefect.example.com/api); empty: install a Prefect server in the namespace"
  type        = string
  default     = ""
}

variable "prefect_server_chart_version" {
  description = "prefect-server Helm chart version (null: the newest; pin it for a campaign)"
  type        = string
  default     = null
}

variable "prefect_worker_chart_version" {
  description = "prefect-worker Helm chart version (null: the newest; pin it for a campaign)"
  type        = string
  default     = null
}

variable "worker_replicas" {
  description = "Prefect workers polling the work pool (each flow run is its own pod; one worker suffices)"
  type        = number
  default     = 1
}

variable "redis_image" {
  description = "Redis for heartbeats, the rendezvous store and the hang view (reliability.redis_url)"
  type        = string
  default     = "redis:7.2-alpine"
}

variable "redis_memory" {
  description = "memory limit of the Redis pod"
  type        = string
  default     = "4Gi"
}

variable "install_nvidia_device_plugin" {
  description = "install NVIDIA's device plugin (skip where the GPU operator or the cloud already runs it)"
  type        = bool
  default     = false
}

variable "nvidia_device_plugin_chart_version" {
  description = "nvidia-device-plugin Helm chart version (null: the newest)"
  type        = string
  default     = null
}

variable "storage_env" {
  description = "environment of the durable store's credentials for flow-run pods and ranks (megatrain/storage/ lists the names)"
  type        = map(string)
  default     = {}
  sensitive   = true
}
