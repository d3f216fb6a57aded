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

variable "megatrain_image" {
  description = "the megatrain image of the Dask scheduler and workers: the same tag or digest as MEGATRAIN_IMAGE of `prefect deploy --name cluster` (the flow pods and ranks)"
  type        = string

  validation {
    condition     = can(regex("(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$", var.megatrain_image)) && !endswith(var.megatrain_image, ":latest")
    error_message = "megatrain_image: pin a tag (not :latest) or a digest, the one the flow pods run (MEGATRAIN_IMAGE)."
  }
}

variable "dask_workers" {
  description = "Dask worker pods for data.engine=dask (each one single-threaded process: one tokenizer core)"
  type        = number
  default     = 4
}

variable "dask_worker_cpu" {
  description = "CPU request of a Dask worker pod"
  type        = string
  default     = "1"
}

variable "dask_worker_memory" {
  description = "memory request and limit of a Dask worker pod, also its --memory-limit (Dask spills and pauses before the OOM killer)"
  type        = string
  default     = "8Gi"
}

variable "dask_scheduler_cpu" {
  description = "CPU request of the Dask scheduler pod"
  type        = string
  default     = "1"
}

variable "dask_scheduler_memory" {
  description = "memory request and limit of the Dask scheduler pod (grows with the work units of a corpus)"
  type        = string
  default     = "4Gi"
}

variable "ingress_namespace" {
  description = "namespace of the ingress controller that serves the Prefect UI: the only way in from outside"
  type        = string
  default     = "ingress-nginx"
}

variable "prefect_ui_url" {
  description = "where operators open the Prefect UI through the ingress (e.g. https://prefect.example.com); the UI calls <url>/api"
  type        = string
  default     = "http://localhost:4200"
}
