{{/* Names: "crihook" for a release named crihook, else "<release>-crihook". 45 characters at most,
so that the longest Service name, <fullname>-scheduler-metrics, stays a DNS label (63). */}}
{{- define "crihook.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 45 | trimSuffix "-" }}
{{- end }}

{{- define "crihook.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := include "crihook.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "crihook.scheduler" -}}{{ include "crihook.fullname" . }}-scheduler{{- end }}
{{- define "crihook.schedulerLeader" -}}{{ include "crihook.fullname" . }}-scheduler-leader{{- end }}
{{- define "crihook.kubeScheduler" -}}{{ include "crihook.fullname" . }}-kube-scheduler{{- end }}
{{- define "crihook.node" -}}{{ include "crihook.fullname" . }}-node{{- end }}

{{/* The scheduler's TLS Secret. */}}
{{- define "crihook.tlsSecret" -}}
{{- if eq .Values.tls.mode "secret" }}
{{- required "tls.secret.name: the Secret holding tls.crt and tls.key (tls.mode=secret)" .Values.tls.secret.name }}
{{- else }}
{{- include "crihook.scheduler" . }}-tls
{{- end }}
{{- end }}

{{/* The Secret of the node pods' metrics certificate; empty when each pod makes its own (selfSigned). */}}
{{- define "crihook.metricsTLSSecret" -}}
{{- $t := .Values.metrics.node.tls }}
{{- if eq $t.mode "secret" }}
{{- required "metrics.node.tls.secret.name: the Secret holding tls.crt, tls.key and ca.crt (metrics.node.tls.mode=secret)" $t.secret.name }}
{{- else if eq $t.mode "certManager" }}
{{- include "crihook.node" . }}-metrics-tls
{{- end }}
{{- end }}

{{/* The name the node pods' metrics certificate carries, which the PodMonitor checks. */}}
{{- define "crihook.metricsServerName" -}}
{{- .Values.metrics.node.tls.serverName | default (printf "%s-node-metrics" (include "crihook.fullname" .)) }}
{{- end }}

{{/* The Service's DNS names, which the certificate must name. */}}
{{- define "crihook.serviceNames" -}}
{{- $svc := include "crihook.scheduler" . -}}
{{- list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) | toJson }}
{{- end }}

{{/* Labels on every object; selectorLabels on the pods (kept short: Services select on them). */}}
{{- define "crihook.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: crihook
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "crihook.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "crihook.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "crihook.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The kube-scheduler image: the cluster's own version unless a tag is given. */}}
{{- define "crihook.kubeSchedulerImage" -}}
{{- $d := .Values.kubeScheduler.deployment.image }}
{{- if $d.tag }}
{{- printf "%s:%s" $d.repository $d.tag }}
{{- else }}
{{- $v := semver .Capabilities.KubeVersion.Version }}
{{- printf "%s:v%d.%d.%d" $d.repository $v.Major $v.Minor $v.Patch }}
{{- end }}
{{- end }}

{{/* The extender's URL: the leader's Service unless given. */}}
{{- define "crihook.urlPrefix" -}}
{{- .Values.kubeScheduler.urlPrefix | default (printf "https://%s.%s.svc:443" (include "crihook.schedulerLeader" .) .Release.Namespace) }}
{{- end }}

{{/* How kube-scheduler reaches the extender, the same for each of its entries: HTTPS to the
certificate's name with kube-scheduler's client certificate, node names only. */}}
{{- define "crihook.extenderConnection" -}}
{{- $deployment := eq .Values.kubeScheduler.mode "deployment" -}}
enableHTTPS: true
tlsConfig:
  caFile: {{ ternary "/etc/kubernetes/crihook/ca.crt" .Values.kubeScheduler.caFile $deployment }}
  # the name the certificate holds, whichever address urlPrefix gives
  serverName: {{ include "crihook.scheduler" . }}.{{ .Release.Namespace }}.svc
  # the client certificate the extender verbs require
  certFile: {{ ternary "/etc/kubernetes/crihook/client.crt" .Values.kubeScheduler.certFile $deployment }}
  keyFile: {{ ternary "/etc/kubernetes/crihook/client.key" .Values.kubeScheduler.keyFile $deployment }}
nodeCacheCapable: true
{{- end }}

{{/* The resources crihook schedules (scheduler/request.py DEVICE_RESOURCES): kube-scheduler sends
the pods asking for one to the extender, and the webhooks see only those pods. */}}
{{- define "crihook.deviceResources" -}}
{{- list "nvidia.com/gpu" "koordinator.sh/gpu" "koordinator.sh/gpu-core" "koordinator.sh/gpu-memory" "koordinator.sh/gpu-memory-ratio" "koordinator.sh/gpu.shared" "koordinator.sh/rdma" | toJson }}
{{- end }}

{{/* The annotations only the scheduler may write (scheduler/webhook.py PROTECTED). */}}
{{- define "crihook.protectedAnnotations" -}}
{{- list "scheduling.koordinator.sh/device-allocated" "gpu.crihook.io/container-devices" | toJson }}
{{- end }}

{{/* The label that takes a pod or a namespace out of the webhooks' conversion ("off"). */}}
{{- define "crihook.optOutLabel" -}}gpu.crihook.io/webhook{{- end }}

{{/* The common name of kube-scheduler's client certificate, the one name the extender verbs answer
(tls.mode generate and certManager; with tls.mode=secret, any certificate the given CA signed). */}}
{{- define "crihook.extenderClient" -}}{{ include "crihook.kubeScheduler" . }}{{- end }}

{{/* The Secret of kube-scheduler's client certificate and its keys: (list name certKey keyKey). */}}
{{- define "crihook.clientSecret" -}}
{{- if eq .Values.tls.mode "generate" }}
{{- list (include "crihook.tlsSecret" .) "client.crt" "client.key" | toJson }}
{{- else if eq .Values.tls.mode "certManager" }}
{{- list (printf "%s-client" (include "crihook.scheduler" .)) "tls.crt" "tls.key" | toJson }}
{{- else }}
{{- list (required "tls.secret.clientSecretName: the Secret of kube-scheduler's client certificate (tls.mode=secret, kubeScheduler.mode=deployment)" .Values.tls.secret.clientSecretName) "tls.crt" "tls.key" | toJson }}
{{- end }}
{{- end }}

{{/* The scheduler's service account as the API server names it (it alone writes allocations). */}}
{{- define "crihook.schedulerUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "crihook.scheduler" . }}
{{- end }}

{{/* The generated CA and certificate as the Secret's data: from the cluster when the Secret is
already there (so `helm upgrade` keeps them and the caBundle still matches), else new. Made once per
render and kept in the values for the other templates (the Secret and both webhook configurations
must hold the same CA). */}}
{{- define "crihook.generatedTLS" -}}
{{- if not (hasKey .Values.tls.generate "made") }}
{{- $name := include "crihook.tlsSecret" . }}
{{- $old := lookup "v1" "Secret" .Release.Namespace $name }}
{{- $data := dict }}
{{- $keys := list "ca.crt" "tls.crt" "tls.key" "client.crt" "client.key" }}
{{- if and $old $old.data (eq (len (pick $old.data "ca.crt" "tls.crt" "tls.key" "client.crt" "client.key")) (len $keys)) }}
{{- $data = pick $old.data "ca.crt" "tls.crt" "tls.key" "client.crt" "client.key" }}
{{- else }}
{{- $days := int .Values.tls.generate.days }}
{{- $ca := genCA (printf "%s-ca" (include "crihook.scheduler" .)) $days }}
{{- $names := include "crihook.serviceNames" . | fromJsonArray }}
{{- $cert := genSignedCert (index $names 2) nil $names $days $ca }}
{{- $client := genSignedCert (include "crihook.extenderClient" .) nil nil $days $ca }}
{{- $data = dict "ca.crt" ($ca.Cert | b64enc) "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "client.crt" ($client.Cert | b64enc) "client.key" ($client.Key | b64enc) }}
{{- end }}
{{- $_ := set .Values.tls.generate "made" $data }}
{{- end }}
{{- index .Values.tls.generate "made" | toJson }}
{{- end }}

{{/* The webhooks' caBundle (base64 PEM), or nothing where cert-manager injects it or none is given. */}}
{{- define "crihook.caBundle" -}}
{{- if eq .Values.tls.mode "generate" }}
{{- index (include "crihook.generatedTLS" . | fromJson) "ca.crt" }}
{{- else if and (eq .Values.tls.mode "secret") .Values.tls.secret.caBundle }}
{{- .Values.tls.secret.caBundle | b64enc }}
{{- end }}
{{- end }}

{{/* A map as TOML: (list "" $map). Numbers go through toJson so that 16777216 stays an integer
(values hold every number as a float, which toToml would write as 1.6777216e+07); keys first,
then each table. */}}
{{- define "crihook.toml" -}}
{{- $prefix := index . 0 }}
{{- $table := index . 1 }}
{{- range $k, $v := $table }}
{{- if not (kindIs "map" $v) }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- range $k, $v := $table }}
{{- if kindIs "map" $v }}
{{- $name := ternary $k (printf "%s.%s" $prefix $k) (eq $prefix "") }}

[{{ $name }}]
{{- include "crihook.toml" (list $name $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The node pods' affinity (node.affinity), with NVIDIA's any-of GPU node rule unless it has a
nodeAffinity of its own: the labels NVIDIA's device-plugin and GPU-operator charts place on. JSON. */}}
{{- define "crihook.nodeAffinity" -}}
{{- $n := .Values.node }}
{{- $affinity := deepCopy $n.affinity }}
{{- if and $n.gpuNodeAffinity (not (hasKey $affinity "nodeAffinity")) }}
{{- $terms := list }}
{{- range $label := list (list "feature.node.kubernetes.io/pci-10de.present" "true") (list "feature.node.kubernetes.io/cpu-model.vendor_id" "NVIDIA") (list "nvidia.com/gpu.present" "true") }}
{{- $terms = append $terms (dict "matchExpressions" (list (dict "key" (index $label 0) "operator" "In" "values" (list (index $label 1))))) }}
{{- end }}
{{- $_ := set $affinity "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms)) }}
{{- end }}
{{- $affinity | toJson }}
{{- end }}

{{- /* Where the node pod sees the host's /, for the check that HAMi-core's library and preload file
exist on the node: the driver's mount when driverRoot is the host's root, else a mount of its own.
Both are type Directory: "/" always exists, so nothing is made on the host and nothing blocks the pod. */}}
{{- define "crihook.hostRoot" -}}
{{- if eq .Values.node.driverRoot "/" }}/run/crihook/driver{{ else }}/run/crihook/host{{ end }}
{{- end }}
