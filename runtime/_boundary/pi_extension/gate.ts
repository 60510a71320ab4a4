/**
 * pi-runtime's tool gate for the real Pi (docs/design/gate.md). Load with `pi -ne -e <this file>`.
 *
 * Re-registers Pi's own `read`, `bash`, `write` and `edit` by spreading Pi's
 * `create*ToolDefinition(cwd, opts)` (so the schemas and the system prompt stay byte-identical,
 * T7) with `executionMode: "sequential"` (a round's calls run one after the other, so each
 * result is persisted as it ends, T8). Each call first asks the runtime over a Unix socket:
 *   POST /before {tool_call_id, name, args} -> run | saved(result) | refused(result)
 * A saved result is returned verbatim and a refusal as an error result; neither runs the tool.
 * After a run, the outcome is reported: POST /after {tool_call_id, name, result}. The result
 * goes back to Pi without waiting for that answer (T11: the gateway holds the model request
 * that carries it until its outcome is durable); the next call's /before waits for it, so the
 * gate sees a call's outcome before the next call's intent, and a report that failed fails
 * every later call closed (the tool does not run).
 *
 * The runtime's own tools (send_text_update, the lifecycle tools, the test tool `effect`) are
 * declared by the runtime in PI_RUNTIME_TOOLS (a JSON list of {name, description, parameters},
 * runtime/_boundary/_tools.py) and registered here as given; they execute in the runtime: the gate answers
 * `saved` with their result (T10), and this process only carries the call.
 *
 * Environment (set by the runtime): PI_RUNTIME_GATE_SOCKET (socket path) and
 * PI_RUNTIME_GATE_SECRET (this epoch's secret). The secret is removed from process.env when the
 * extension loads, before any tool can run, so tools (bash's environment) never see it (T6).
 * The gateway secret (PI_RUNTIME_GATEWAY_SECRET) must stay in process.env, since Pi resolves the
 * model key "$PI_RUNTIME_GATEWAY_SECRET" from it at request time; bash's spawnHook removes it
 * from every command's environment instead.
 * Without both gate variables, loading fails and Pi exits 1 before answering any command.
 *
 * Only node:* built-ins are imported (Pi does not expose undici or openai to extensions).
 * Registers no commands.
 */
import type { ExtensionAPI } from "@earendil-works/pi-coding-agent";
import {
	createBashToolDefinition,
	createEditToolDefinition,
	createReadToolDefinition,
	createWriteToolDefinition,
} from "@earendil-works/pi-coding-agent";
import { readFileSync } from "node:fs";
import { request } from "node:http";
import { join } from "node:path";

const SOCKET_ENV = "PI_RUNTIME_GATE_SOCKET";
const SECRET_ENV = "PI_RUNTIME_GATE_SECRET";
const TOOLS_ENV = "PI_RUNTIME_TOOLS";
const HIDDEN_FROM_TOOLS = ["PI_RUNTIME_GATEWAY_SECRET", SECRET_ENV];

const SOCKET = process.env[SOCKET_ENV] ?? "";
const SECRET = process.env[SECRET_ENV] ?? "";
delete process.env[SECRET_ENV]; // T6: tools inherit process.env; the secret is gone before any runs

type Factory = (cwd: string, options?: any) => any;
const FACTORIES: Array<[string, Factory, string]> = [
	["read", createReadToolDefinition, "read"],
	["bash", createBashToolDefinition, "bash"],
	["edit", createEditToolDefinition, "edit"],
	["write", createWriteToolDefinition, "write"],
];

/** The options Pi passes its built-ins, from the agent directory's settings.json. */
function toolOptions(): Record<string, any> {
	let settings: any = {};
	const dir = process.env.PI_CODING_AGENT_DIR;
	if (dir) {
		try {
			settings = JSON.parse(readFileSync(join(dir, "settings.json"), "utf8"));
		} catch {
			settings = {};
		}
	}
	return {
		read: { autoResizeImages: settings?.images?.autoResize ?? true },
		bash: {
			commandPrefix: settings?.shellCommandPrefix,
			shellPath: settings?.shellPath,
			spawnHook: hideSecrets,
		},
	};
}

/** bash's spawnHook: no command's environment carries a runtime secret (T6). */
function hideSecrets(context: { command: string; cwd: string; env: NodeJS.ProcessEnv }) {
	const env = { ...context.env };
	for (const name of HIDDEN_FROM_TOOLS) delete env[name];
	return { ...context, env };
}

/** The runtime tools to register, from PI_RUNTIME_TOOLS (absent: none). */
function runtimeTools(): Array<{ name: string; description: string; parameters: any }> {
	const text = process.env[TOOLS_ENV];
	if (!text) return [];
	const tools = JSON.parse(text);
	if (!Array.isArray(tools)) throw new Error(`pi-runtime gate: ${TOOLS_ENV} must be a JSON list`);
	return tools;
}

function post(path: string, body: unknown, signal?: AbortSignal): Promise<any> {
	return new Promise((resolve, reject) => {
		const data = Buffer.from(JSON.stringify(body), "utf8");
		const req = request(
			{
				socketPath: SOCKET,
				path,
				method: "POST",
				headers: {
					"content-type": "application/json",
					"content-length": String(data.length),
					authorization: `Bearer ${SECRET}`,
				},
				signal,
			},
			(res) => {
				const chunks: Buffer[] = [];
				res.on("data", (chunk: Buffer) => chunks.push(chunk));
				res.on("error", reject);
				res.on("end", () => {
					const text = Buffer.concat(chunks).toString("utf8");
					if (res.statusCode !== 200) {
						reject(new Error(`tool gate ${path}: HTTP ${res.statusCode}: ${text}`));
						return;
					}
					try {
						resolve(JSON.parse(text));
					} catch (error: any) {
						reject(new Error(`tool gate ${path}: not JSON: ${error?.message ?? error}`));
					}
				});
			},
		);
		req.on("error", (error: any) => reject(new Error(`tool gate unreachable (gate_unreachable): ${error?.message ?? error}`)));
		req.end(data);
	});
}

/** The last outcome reported (/after); the next /before waits for it (T11, T18). */
let reported: Promise<unknown> = Promise.resolve();

/** Report a call's outcome without holding its result back: the next call waits for it. */
function report(body: unknown): void {
	const answered = post("/after", body);
	answered.catch(() => undefined); // its failure is the next call's: never unhandled
	reported = answered;
}

/** Ask the gate about a call, once the outcome reported before it was answered. */
async function before(body: unknown, signal?: AbortSignal): Promise<any> {
	await reported; // a failed report fails this call closed: it does not run
	return post("/before", body, signal);
}

function asResult(value: any): any {
	return { content: value?.content ?? [], details: value?.details, isError: value?.isError === true };
}

export default function (pi: ExtensionAPI) {
	if (!SOCKET || !SECRET) {
		throw new Error(`pi-runtime gate: ${SOCKET_ENV} and ${SECRET_ENV} must be set`);
	}
	const options = toolOptions();
	const cwd = process.cwd();
	for (const [name, factory, optionKey] of FACTORIES) {
		const builtin = factory(cwd, options[optionKey]);
		// the tool as Pi would build it for a call's cwd: built once per cwd, not per call
		const built = new Map<string, any>([[cwd, builtin]]);
		const implFor = (at: string) => {
			let impl = built.get(at);
			if (impl === undefined) {
				impl = factory(at, options[optionKey]);
				built.set(at, impl);
			}
			return impl;
		};
		pi.registerTool({
			...builtin,
			executionMode: "sequential" as const,
			async execute(toolCallId: string, params: any, signal: AbortSignal | undefined, onUpdate: any, ctx: any) {
				const decision = await before({ tool_call_id: toolCallId, name, args: params }, signal);
				if (decision?.decision === "saved") return asResult(decision.result);
				if (decision?.decision === "refused") return { ...asResult(decision.result), isError: true };
				if (decision?.decision !== "run") throw new Error(`tool gate: unknown decision ${JSON.stringify(decision)}`);
				const impl = implFor(ctx?.cwd ?? cwd);
				let result: any;
				try {
					result = await impl.execute(toolCallId, params, signal, onUpdate, ctx);
				} catch (error: any) {
					// Pi hands the model the error's message as an error result: report exactly that
					const text = error instanceof Error ? error.message : String(error);
					report({
						tool_call_id: toolCallId,
						name,
						result: { content: [{ type: "text", text }], isError: true },
					});
					throw error;
				}
				report({
					tool_call_id: toolCallId,
					name,
					result: { content: result?.content ?? [], details: result?.details, isError: result?.isError === true },
				});
				return result;
			},
		});
	}
	for (const tool of runtimeTools()) {
		pi.registerTool({
			name: tool.name,
			label: tool.name,
			description: tool.description,
			parameters: tool.parameters,
			executionMode: "sequential" as const,
			async execute(toolCallId: string, params: any, signal: AbortSignal | undefined) {
				// T10: the runtime runs it behind the gate; this process only carries the call
				const decision = await before({ tool_call_id: toolCallId, name: tool.name, args: params }, signal);
				if (decision?.decision === "saved") return asResult(decision.result);
				if (decision?.decision === "refused") return { ...asResult(decision.result), isError: true };
				throw new Error(`tool gate: ${tool.name} is a runtime tool; unexpected decision ${JSON.stringify(decision)}`);
			},
		});
	}
}
