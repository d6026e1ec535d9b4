{{/* Names, labels and shared snippets of the meshd chart. */}}

{{- define "meshd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "meshd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "meshd.selector" (list . "webhook") */}}
{{- define "meshd.selector" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ $ctx.Chart.Name }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "meshd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* OpenTelemetry exporter settings, as the SDK's standard environment variables. */}}
{{- define "meshd.otelEnv" -}}
{{- $ctx := index . 0 -}}
{{- $otlp := $ctx.Values.telemetry.otlp -}}
- name: OTEL_SERVICE_NAME
  value: {{ printf "meshd-%s" (index . 1) | quote }}
{{- if $otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otlp.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $otlp.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $otlp.sampleRatio | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
{{- end -}}

{{- define "meshd.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* nodeSelector/tolerations/affinity/imagePullSecrets of one component's values. */}}
{{- define "meshd.scheduling" -}}
{{- $ctx := index . 0 -}}
{{- $v := index . 1 -}}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget when a component runs more than one replica. */}}
{{- define "meshd.pdb" -}}
{{- $ctx := index . 0 -}}
{{- $component := index . 1 -}}
{{- $v := index . 2 -}}
{{- if gt (int $v.replicas) 1 }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "meshd.fullname" $ctx }}-{{ $component }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "meshd.labels" $ctx | nindent 4 }}
spec:
  minAvailable: {{ $v.podDisruptionBudget.minAvailable }}
  selector:
    matchLabels:
      {{- include "meshd.selector" (list $ctx $component) | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "meshd.webhookSecret" -}}
{{- if eq .Values.webhook.tls.mode "secret" -}}
{{- .Values.webhook.tls.secretName -}}
{{- else -}}
{{- include "meshd.fullname" . }}-webhook-tls
{{- end -}}
{{- end -}}

{{/* DNS names a certificate for Service NAME in the release namespace must carry. */}}
{{- define "meshd.serviceDNS" -}}
{{- $ctx := index . 0 -}}
{{- $svc := index . 1 -}}
{{- $ns := $ctx.Release.Namespace -}}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) -}}
{{- end -}}

{{/*
A CA-signed TLS Secret's data, made at install with genCA/genSignedCert, or the data of the
Secret already in the cluster (lookup) so an upgrade keeps the same CA.
Call: include "meshd.tlsData" (list . SECRET_NAME SERVICE_NAME CA_NAME DAYS) -> JSON.
*/}}
{{- define "meshd.tlsData" -}}
{{- $ctx := index . 0 -}}
{{- $secret := index . 1 -}}
{{- $svc := index . 2 -}}
{{- $days := int (index . 4) -}}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace $secret -}}
{{- if and $existing (hasKey ($existing.data | default dict) "ca.crt") -}}
{{- toJson $existing.data -}}
{{- else -}}
{{- $ca := genCA (index . 3) $days -}}
{{- $names := include "meshd.serviceDNS" (list $ctx $svc) | fromJsonArray -}}
{{- $cert := genSignedCert (index $names 2) nil $names $days $ca -}}
{{- toJson (dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc)) -}}
{{- end -}}
{{- end -}}

{{/*
The control plane's pods when there are several (a StatefulSet: controlPlane.shards > 1,
one pod a shard; or controlPlane.replicas > 1, every pod holding everything), as a JSON
list: <release>-control-plane-<i>.<release>-control-plane-headless.<ns>.svc:<port>.
*/}}
{{- define "meshd.controlPlanePods" -}}
{{- $v := .Values.controlPlane -}}
{{- if gt (int $v.shards) 1 }}{{ int $v.shards }}{{ else }}{{ int $v.replicas }}{{ end -}}
{{- end -}}
{{- define "meshd.shardAddresses" -}}
{{- $fullname := include "meshd.fullname" . -}}
{{- $v := .Values.controlPlane -}}
{{- $out := list -}}
{{- range $i := until (int (include "meshd.controlPlanePods" .)) -}}
{{- $out = append $out (printf "%s-control-plane-%d.%s-control-plane-headless.%s.svc:%d" $fullname $i $fullname $.Release.Namespace (int $v.xdsPort)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
The names the control plane's certificate carries, as a JSON list: its Service's DNS names,
each pod's name behind the headless Service when there are several (what agents and sidecars
dial then), and mtls.extraDNSNames. Clients check the name they dial against these.
*/}}
{{- define "meshd.controlPlaneDNS" -}}
{{- $fullname := include "meshd.fullname" . -}}
{{- $svc := printf "%s-control-plane" $fullname -}}
{{- $names := include "meshd.serviceDNS" (list . $svc) | fromJsonArray -}}
{{- $pods := int (include "meshd.controlPlanePods" .) -}}
{{- if gt $pods 1 -}}
{{- $headless := printf "%s-control-plane-headless.%s.svc" $fullname .Release.Namespace -}}
{{- range $i := until $pods -}}
{{- $names = append $names (printf "%s-%d.%s" $svc $i $headless) -}}
{{- $names = append $names (printf "%s-%d.%s.cluster.local" $svc $i $headless) -}}
{{- end -}}
{{- end -}}
{{- concat $names (.Values.mtls.extraDNSNames | default list) | uniq | toJson -}}
{{- end -}}

{{/*
The ClusterIssuer every mesh certificate comes from with mtls.mode certManager, as JSON
(an issuerRef): mtls.certManager.issuerRef, or the CA ClusterIssuer the chart makes.
*/}}
{{- define "meshd.meshIssuer" -}}
{{- $ref := .Values.mtls.certManager.issuerRef | default dict -}}
{{- if $ref.name -}}
{{- toJson $ref -}}
{{- else -}}
{{- toJson (dict "name" (printf "%s-mesh-ca" (include "meshd.fullname" .)) "kind" "ClusterIssuer" "group" "cert-manager.io") -}}
{{- end -}}
{{- end -}}

{{/*
One certificate of the mesh CA (mtls.mode generate) as JSON {data, annotations} for a
kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt). The Secret already in the cluster is
kept (lookup) while it holds the same CA's certificate, was made for the same names, and is
not in the last third of its validity (meshd.io/renew-after: a helm upgrade after that date
signs a new one); else a new certificate is signed by the CA.
Call: include "meshd.meshCert" (dict "ctx" . "ca" CA "namespace" NS "secret" NAME "cn" CN
"dns" LIST "ips" LIST "days" N)
*/}}
{{- define "meshd.meshCert" -}}
{{- $days := int .days -}}
{{- $caCrt := .ca.Cert | b64enc -}}
{{- $spec := dict "cn" .cn "dns" .dns "ips" .ips | toJson | sha256sum | trunc 16 -}}
{{- $now := now | unixEpoch | int64 -}}
{{- $existing := include "meshd.lookupSecret" (list .ctx .namespace .secret) | fromJson -}}
{{- $data := $existing.data | default dict -}}
{{- $ann := ($existing.metadata | default dict).annotations | default dict -}}
{{- $renewAfter := index $ann "meshd.io/renew-after" | default "0" | int64 -}}
{{- if and (eq (index $data "ca.crt" | default "") $caCrt) (eq (index $ann "meshd.io/cert-spec" | default "") $spec) (lt $now $renewAfter) (hasKey $data "tls.key") -}}
{{- toJson (dict "data" $data "annotations" (dict "meshd.io/cert-spec" $spec "meshd.io/renew-after" (toString $renewAfter))) -}}
{{- else -}}
{{- $cert := genSignedCert .cn .ips .dns $days .ca -}}
{{- $renew := add $now (div (mul $days 86400 2) 3) -}}
{{- $out := dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" $caCrt -}}
{{- toJson (dict "data" $out "annotations" (dict "meshd.io/cert-spec" $spec "meshd.io/renew-after" (toString $renew))) -}}
{{- end -}}
{{- end -}}

{{/*
A Secret in the cluster as JSON ({} when there is none, or no cluster: helm template).
One place for lookup, which tests/test_helm_chart.py replaces to play upgrades offline.
Call: include "meshd.lookupSecret" (list . NAMESPACE NAME)
*/}}
{{- define "meshd.lookupSecret" -}}
{{- lookup "v1" "Secret" (index . 1) (index . 2) | default dict | toJson -}}
{{- end -}}
