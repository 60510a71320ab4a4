/**
 * pi-runtime's tool gate for the real Pi (docs/design/gate.md). Load with `pi -ne -e <this file>`.
 *
 * Re-registers Pi's own `read`, `bash`, `write` and `edit` by spreading Pi's
 * `create*ToolDefinition(cwd, opts)` (so the schemas and the system prompt stay byte-identical,
 * T7) with `executionMode: "sequential"` (a round's calls run one after the other, so each
 * result is persisted as it ends, T8). Each call first asks the runtime over a Unix socket:
 *   POST /before {tool_call_id, name, args, follows?} -> run | saved(result) | refused(result)
 * A saved result is returned verbatim and a refusal as an error result; neither runs the tool.
 * After a run, the outcome is reported: POST /after {tool_call_id, name, result}. The result
 * goes back to Pi without waiting for that answer (T11: the gateway holds the model request
 * that carries it until its outcome is durable); the next call's /before waits for it, so the
 * gate sees a call's outcome before the next call's intent. Whether a failed report fails the
 * next call is the gate's to judge, not this process's (T21): each /before names the call
 * this process ran and reported last (`follows`), and the gate, which knows whether it recorded
 * that outcome in the journal of its delivery and epoch, refuses the call there if not (the
 * tool does not run); a report refused because its delivery ended meanwhile fails no call of
 * the next delivery. An aborted call (Pi's abort: the user's, a signal's) has its outcome
 * reported as any other, the error result Pi records for it (T23): thrown by the tool while it
 * ran, or — aborted while the gate decided it — "aborted and did not run", reported once the
 * gate's answer says it was let run (the tool never starts after an abort). A call whose
 * /before got no answer (the connection failed: the gate may have let it run) is reported the
 * same way, with the error Pi records for it, aborted or not (T24): else the gate held it as
 * running, and the model request carrying its result waited at the barrier until the
 * delivery's end. A runtime tool's call is not given up on an abort once asked: the gate runs
 * it whatever the worker does, so its answer is awaited and is the call's result (T25).
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
import { createConnection, type Socket } from "node:net";
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

/** A gate request's answer: its status and its body's text. */
type Answer = { status: number; text: string };

/**
 * The connection to the gate: HTTP/1.1 over its Unix socket, written and read here rather than
 * through node:http, whose client cost Pi four times the CPU per tool call (performance.md, "The
 * gate's client"). One request at a time on one kept connection, opened again once the gate
 * closed it. The gate's shell answers every request whole, framed by Content-Length
 * (boundaries.md B10): any other answer, or bytes nobody asked for, fail the request and drop
 * the connection — the call fails closed, as for an unreachable gate.
 */
class GateLink {
	private socket: Socket | null = null;
	/** What arrived of the answer, in pieces: joined once its head is in, then once whole (a
	 * saved result can be megabytes: joining at every piece would copy it over and over). */
	private pieces: Buffer[] = [];
	private size = 0;
	/** The answer's head, once read: its status, where its body starts and ends, its close. */
	private head: { status: number; start: number; whole: number; close: boolean } | null = null;
	private waiter: { resolve: (answer: Answer) => void; reject: (error: Error) => void } | null = null;
	private tail: Promise<unknown> = Promise.resolve();

	/** Send one request once every earlier one was answered (or failed); its answer. A request
	 * sent is never given up (an abort does not drop it: T23): its answer says what the gate did. */
	send(path: string, data: Buffer): Promise<Answer> {
		const turn = this.tail.then(() => this.exchange(path, data));
		this.tail = turn.catch(() => undefined);
		return turn;
	}

	private exchange(path: string, data: Buffer): Promise<Answer> {
		return new Promise<Answer>((resolve, reject) => {
			const socket = this.socket ?? this.open();
			this.waiter = { resolve, reject };
			const head =
				`POST ${path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n` +
				`content-length: ${data.length}\r\nauthorization: Bearer ${SECRET}\r\n\r\n`;
			socket.write(Buffer.concat([Buffer.from(head, "latin1"), data]));
		});
	}

	private open(): Socket {
		const socket = createConnection(SOCKET);
		socket.on("data", (chunk: Buffer) => this.take(chunk, socket));
		socket.on("error", (error: Error) => this.fail(error, socket));
		socket.on("end", () => this.fail(new Error("the gate closed the connection"), socket));
		socket.on("close", () => this.fail(new Error("the gate closed the connection"), socket));
		this.socket = socket;
		this.forget();
		return socket;
	}

	/** ``socket`` cannot carry another request: drop it, and fail the request waiting on it
	 * (a late event of a connection already dropped changes nothing). */
	private fail(error: Error, socket: Socket): void {
		if (socket !== this.socket) return;
		this.socket = null;
		this.forget();
		socket.destroy();
		const waiter = this.waiter;
		this.waiter = null;
		waiter?.reject(error);
	}

	private forget(): void {
		this.pieces = [];
		this.size = 0;
		this.head = null;
	}

	private take(chunk: Buffer, socket: Socket): void {
		if (socket !== this.socket) return;
		this.pieces.push(chunk);
		this.size += chunk.length;
		if (this.head === null) {
			const received = this.pieces.length > 1 ? Buffer.concat(this.pieces) : chunk;
			this.pieces = [received];
			const end = received.indexOf("\r\n\r\n");
			if (end < 0) {
				if (this.size > 65536) this.fail(new Error("the gate's answer has no head"), socket);
				return;
			}
			const lines = received.subarray(0, end).toString("latin1").split("\r\n");
			const status = /^HTTP\/1\.[01] ([0-9]{3})(?: |$)/.exec(lines[0]);
			let length = -1;
			let close = false;
			for (const line of lines.slice(1)) {
				const colon = line.indexOf(":");
				const name = line.slice(0, colon).trim().toLowerCase();
				const value = line.slice(colon + 1).trim().toLowerCase();
				if (colon < 0 || name === "transfer-encoding") length = -2;
				else if (name === "content-length") length = length === -1 && /^[0-9]+$/.test(value) ? Number(value) : -2;
				else if (name === "connection") close = close || value.split(",").some((token) => token.trim() === "close");
			}
			if (status === null || length < 0) {
				this.fail(new Error("the gate's answer is not HTTP/1.1 framed by one Content-Length"), socket);
				return;
			}
			this.head = { status: Number(status[1]), start: end + 4, whole: end + 4 + length, close };
		}
		const head = this.head;
		if (this.size < head.whole) return;
		const waiter = this.waiter;
		if (waiter === null || this.size > head.whole) {
			this.fail(new Error("the gate sent what no request asked for"), socket);
			return;
		}
		const received = this.pieces.length > 1 ? Buffer.concat(this.pieces) : this.pieces[0];
		const text = received.subarray(head.start, head.whole).toString("utf8");
		this.waiter = null;
		this.forget();
		if (head.close) {
			this.socket = null;
			socket.destroy();
		}
		waiter.resolve({ status: head.status, text });
	}
}

const link = new GateLink();

/** A request that got no answer the gate could have meant (the connection failed, or a 200
 * whose body is not JSON): the gate may have acted on it — a /before may have been let run
 * (T24). An answer that is not 200 says the gate did not. */
class Unanswered extends Error {}

async function post(path: string, body: unknown): Promise<any> {
	const data = Buffer.from(JSON.stringify(body), "utf8");
	let answer: Answer;
	try {
		answer = await link.send(path, data);
	} catch (error: any) {
		throw new Unanswered(`tool gate unreachable (gate_unreachable): ${error?.message ?? error}`);
	}
	if (answer.status !== 200) {
		throw new Error(`tool gate ${path}: HTTP ${answer.status}: ${answer.text}`);
	}
	try {
		return JSON.parse(answer.text);
	} catch (error: any) {
		throw new Unanswered(`tool gate ${path}: not JSON: ${error?.message ?? error}`);
	}
}

/** The runtime tools registered here: their outcome is the gate's own, never reported (T19). */
const RUNTIME_NAMES = new Set<string>();

/** The last outcome reported (/after), once answered or failed; the next /before waits for
 * it (T11, T18). Never a rejection: a failed report is not kept here (T21). */
let reported: Promise<void> = Promise.resolve();
/** The tool-call id of the call this process ran and reported last: every /before names it
 * (`follows`), and the gate refuses the call while that outcome is missing there (T21). */
let follows: string | undefined;

/** Report a call's outcome without holding its result back: the next call waits for it. */
function report(body: { tool_call_id: string; name: string; result: unknown }): void {
	follows = body.tool_call_id;
	reported = post("/after", body).then(
		() => undefined,
		() => undefined,
	);
}

/**
 * Ask the gate about a call, once the outcome reported before it was answered (T18). A report
 * that failed fails this call closed only where the proof it withheld is needed, and the gate
 * is what knows (T21): it refuses the call while the call it `follows`, let run in the same
 * delivery and epoch, has no recorded outcome. Kept here, the failure failed every later call
 * of this process — those of every later delivery too, once a report reached the gate after
 * its delivery had ended (the next delivery's journal answers it 409).
 */
async function before(
	body: { tool_call_id: string; name: string; args: unknown },
	signal?: AbortSignal,
): Promise<any> {
	await reported;
	if (signal?.aborted) throw new Error(abortedText(body.name)); // nothing asked, nothing let run
	const asked = post("/before", follows === undefined ? body : { ...body, follows });
	// T25: a runtime tool is the gate's to run, and an abort cannot stop it there: the call
	// waits for the gate's answer, aborted or not, and Pi hands the model what the gate did
	if (signal === undefined || RUNTIME_NAMES.has(body.name)) {
		return asked.catch((error) => {
			unanswered(error, body.tool_call_id, body.name, error?.message);
			if (error instanceof Unanswered && RUNTIME_NAMES.has(body.name)) {
				// T26: the gate runs a runtime tool inside /before: an answer lost after it acted
				// leaves the effect done, and the model is told it may have run
				throw new Error(`${error.message}; ${possiblyRan(body.name)}`);
			}
			throw error;
		});
	}
	return new Promise<any>((resolve, reject) => {
		const aborted = () => {
			// T23: Pi records this error as the call's result and goes on at once; the gate may
			// have let the call run all the same (its intent durable first, T2). The tool never
			// starts: once the answer comes, a *run* is reported with the result Pi recorded, so
			// the journal holds what the model is told and the model request carrying it passes
			// the barrier (T11). The next call's /before waits for that report (T18).
			const text = abortedText(body.name);
			abandon(asked, body.tool_call_id, body.name, text);
			reject(new Error(text));
		};
		signal.addEventListener("abort", aborted, { once: true });
		asked.then(
			(decision) => {
				signal.removeEventListener("abort", aborted);
				resolve(decision);
			},
			(error) => {
				signal.removeEventListener("abort", aborted);
				// after an abort, abandon() reports what Pi recorded; else Pi records this error
				if (!signal.aborted) unanswered(error, body.tool_call_id, body.name, error?.message);
				reject(error);
			},
		);
	});
}

/** A call whose /before got no answer (T24): the gate may have let it run (its intent durable
 * first, T2) and holds it as running until its outcome is reported — the model request carrying
 * its result waits for that at the barrier (T11). Its tool never started here: report the error
 * result Pi records for it, as for a *run* (a call the gate did not let run is answered 409,
 * which holds nothing back: T21). An answer that is not 200 let nothing run: nothing to report.
 * Returns whether it reported. */
function unanswered(error: unknown, toolCallId: string, name: string, text: string): boolean {
	if (!(error instanceof Unanswered) || RUNTIME_NAMES.has(name)) return false; // T19: the gate's own
	report({ tool_call_id: toolCallId, name, result: { content: [{ type: "text", text }], isError: true } });
	return true;
}

/** What the model is told, after why, of a runtime tool whose /before got no answer (T26). */
function possiblyRan(name: string): string {
	return `${name} may have run in the runtime (possibly ran): inspect before repeating`;
}

/** The error a call aborted before its tool started ends with (Pi hands the model its text). */
function abortedText(name: string): string {
	return `tool ${name} was aborted and did not run`;
}

/** A call abandoned while the gate decided it (T23): if the gate answers *run* — or no answer
 * comes, so it may have (T24) — the outcome reported is ``text``, the error result Pi recorded
 * for it; the next /before waits for it. */
function abandon(asked: Promise<any>, toolCallId: string, name: string, text: string): void {
	reported = asked.then(
		(decision) => {
			if (decision?.decision !== "run") return undefined; // saved, refused: nothing let run
			report({ tool_call_id: toolCallId, name, result: { content: [{ type: "text", text }], isError: true } });
			return reported;
		},
		// T24: no answer, so the gate may have let it run (an answer not 200 let nothing run);
		// `reported` is this chain's own promise until unanswered() reports
		(error) => (unanswered(error, toolCallId, name, text) ? reported : undefined),
	);
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
		RUNTIME_NAMES.add(tool.name);
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
